"""Policies by ``module:Class``, and every policy spec checked before anything starts.

A spec is a built-in name, which its driver builds, or a ``module:Class`` imported as ``python -m`` would find it.
The class needs its kind's Protocol methods, and a constructor that takes the configured arguments and the offered
keywords (``PolicyKind.context``) it names; a configured argument wins. Every failure is one ``PolicyError`` line.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from minifaas.policy.codec_policy import MODES, CompressionPolicy
from minifaas.policy.interfaces import CodecPolicy, LongTermControl, RoutingPolicy, ShortTermControl, SnapshotPlacement
from minifaas.policy.long_term import LongTermPolicy
from minifaas.policy.router import Router
from minifaas.policy.short_term import ShortTermPolicy
from minifaas.policy.snapshot_policy import IntervalSnapshots, ReuseSnapshots

Args = tuple[tuple[str, Any], ...]  # keyword arguments as a frozen config holds them: sorted (name, value) pairs


class PolicyError(ValueError):
    """A policy spec that cannot be loaded or built; the message is one line that names the spec."""


@dataclass(frozen=True)
class PolicyKind:
    name: str  # router, short_term, long_term, snapshot, codec
    protocol: type
    builtins: Mapping[str, tuple[type, Args]]  # name -> (the class its driver builds, the arguments it implies)
    context: tuple[str, ...]  # the keywords the driver offers its constructor

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(n for n, v in vars(self.protocol).items() if callable(v) and not n.startswith("_"))


def policy_args(args: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> Args:
    """Keyword arguments (a TOML table, or pairs) as a frozen config keeps them."""
    return tuple(sorted(dict(args).items()))


ROUTER = PolicyKind("router", RoutingPolicy, {"default": (Router, ())}, ("config",))
SHORT_TERM = PolicyKind(
    "short_term", ShortTermControl, {"default": (ShortTermPolicy, ())}, ("config", "threshold", "rule")
)
LONG_TERM = PolicyKind(
    "long_term", LongTermControl, {"default": (LongTermPolicy, ())},
    ("config", "case", "threshold", "n_prefill", "n_decode"),
)  # fmt: skip
SNAPSHOT = PolicyKind(
    "snapshot", SnapshotPlacement, {"reuse": (ReuseSnapshots, ()), "interval": (IntervalSnapshots, ())},
    ("interval_blocks",),
)  # fmt: skip
CODEC = PolicyKind("codec", CodecPolicy, {m: (CompressionPolicy, policy_args({"mode": m})) for m in MODES}, ())
KINDS = {k.name: k for k in (ROUTER, SHORT_TERM, LONG_TERM, SNAPSHOT, CODEC)}


def load_policy(spec: str, kind: PolicyKind, args: Mapping[str, Any] | Args = (), **context: Any) -> Any:
    """The policy ``spec`` names, built with ``args`` and the ``context`` keywords its constructor names."""
    if set(context) != set(kind.context):
        raise TypeError(f"a {kind.name} policy is offered {sorted(kind.context)}, got {sorted(context)}")
    cls, keywords = _checked(spec, kind, args, context)
    with building(kind, spec):
        return cls(**keywords)


@contextmanager
def building(kind: PolicyKind, spec: str) -> Iterator[None]:
    """Building the ``spec`` policy: a TypeError or ValueError its constructor raises is the line that names it."""
    try:
        yield
    except PolicyError:
        raise
    except (TypeError, ValueError) as e:
        raise PolicyError(f"{kind.name} {spec!r}: {type(e).__name__}: {_line(e)}") from e


def check_policy(spec: str, kind: PolicyKind, args: Mapping[str, Any] | Args = ()) -> type:
    """The class ``spec`` names, checked as ``load_policy`` checks it, without building it."""
    return _checked(spec, kind, args, dict.fromkeys(kind.context))[0]


def _checked(
    spec: str, kind: PolicyKind, args: Mapping[str, Any] | Args, context: Mapping[str, Any]
) -> tuple[type, dict[str, Any]]:
    cls, implied = kind.builtins.get(spec) or (_plugin_class(spec, kind), ())
    class_name = cls.__name__
    missing = [f"{m}()" for m in kind.methods if not callable(getattr(cls, m, None))]
    if missing:
        raise PolicyError(f"{kind.name} {spec!r}: not a {kind.name} policy: {class_name} has no {', '.join(missing)}")
    given = {**dict(implied), **dict(args)}  # the configured arguments win over the offered keywords
    signature = inspect.signature(cls)
    params = signature.parameters
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params.values())
    keywords = {k: v for k, v in context.items() if open_ended or k in params} | given
    try:
        signature.bind(**keywords)
    except TypeError as e:
        raise PolicyError(f"{kind.name} {spec!r}: its constructor refuses {sorted(dict(args))}: {e}") from None
    return cls, keywords


def _plugin_class(spec: str, kind: PolicyKind) -> type:
    """The class a ``module:Class`` spec names, its module imported."""
    module_name, colon, class_name = spec.partition(":")
    if not (colon and module_name and class_name):
        raise PolicyError(f"{kind.name} {spec!r}: neither a built-in ({', '.join(kind.builtins)}) nor module:Class")
    cls = getattr(_module(module_name, spec, kind), class_name, None)
    if not isinstance(cls, type):
        raise PolicyError(f"{kind.name} {spec!r}: {module_name} has no class {class_name}")
    return cls


def _module(name: str, spec: str, kind: PolicyKind) -> Any:
    """Import ``name``; a module not installed is looked for under the current directory, as ``python -m``
    and ``python -c`` look (the ``minifaas`` script's own directory is not the project's)."""
    try:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            here = os.getcwd()
            if e.name != name.partition(".")[0] or here in sys.path or "" in sys.path:
                raise
            sys.path.insert(0, here)
            return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise PolicyError(
            f"{kind.name} {spec!r}: no module named {e.name!r} (installed, or under {os.getcwd()})"
        ) from None
    except Exception as e:  # the module itself fails: a syntax error, an import of its own
        raise PolicyError(f"{kind.name} {spec!r}: importing {name} failed: {type(e).__name__}: {_line(e)}") from None


def _line(e: BaseException) -> str:
    return " ".join(str(e).split())
