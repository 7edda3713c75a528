"""Keep flash-linear-attention and Triton out of CPU processes, and report which kernels each layer kind really runs.

transformers binds fla's Triton kernels when a modeling module is imported, and those fail on a machine without
a GPU, so a CPU process makes ``import fla`` fail before any model code loads. A binding is not yet a call:
``KernelRecorder`` notes during warm-up what each layer kind really called, and a CUDA worker refuses the torch
reference unless told otherwise (``require_fast``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import CellType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BLOCKED = ("fla", "causal_conv1d")


def select_kernels(device: str) -> str:
    """Call before importing model code. Returns "fla" or "torch" (the reference kernels)."""
    if device.startswith("cuda"):
        if any(sys.modules.get(name, False) is None for name in BLOCKED):
            raise RuntimeError("fla was blocked earlier in this process; a CUDA worker must run in its own process")
        return "fla"
    # transformers warns once per kernel that it falls back to the torch reference: here that is the plan
    logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
    for name in BLOCKED:
        loaded = sys.modules.get(name)
        if loaded is not None:
            raise RuntimeError(f"{name} was imported before the CPU kernel choice; import minifaas.model first")
        sys.modules[name] = None  # type: ignore[assignment]  # makes `import fla` raise ImportError
    # transformers' masking code imports torch's compiler, which imports triton where it is installed: a CPU
    # process compiles nothing, so it is kept out too (unless something loaded it already)
    sys.modules.setdefault("triton", None)  # type: ignore[arg-type]
    return "torch"


@dataclass(frozen=True, slots=True)
class KernelBinding:
    """One function a modeling module routes to an optional package: which one it really calls."""

    function: str  # the name transformers looks up, e.g. "chunk_gated_delta_rule"
    package: str  # the package it prefers, e.g. "fla"
    module: str  # where the function in use lives: the package's module, or transformers' own (the fallback)
    layer_kind: str = ""  # a recorded call: the kind of layer that made it, e.g. "linear_attention"

    @property
    def fast(self) -> bool:
        return self.module.split(".")[0] == self.package


@dataclass(frozen=True, slots=True)
class KernelReport:
    bindings: tuple[KernelBinding, ...]
    ran: tuple[KernelBinding, ...] = ()  # what recorded forwards called (``KernelRecorder``); empty: none recorded

    @property
    def slow(self) -> tuple[KernelBinding, ...]:
        """Functions of a fast-path package (fla) that fell back to the torch reference: those that ran, once
        something was recorded, else those bound."""
        return tuple(b for b in self.ran or self.bindings if b.package in FAST_PACKAGES and not b.fast)

    @property
    def label(self) -> str:
        """ "fla": every fla function ran (before any ran: is bound to) fla; "torch": some fell back; "none": the
        model needs none."""
        if not any(b.package in FAST_PACKAGES for b in self.ran or self.bindings):
            return "none"
        return "torch" if self.slow else "fla"

    def to_json(self) -> dict:
        ran: dict[str, dict[str, str]] = {}
        for call in self.ran:
            ran.setdefault(call.layer_kind, {})[call.function] = call.module
        return {"kernels": self.label, "bindings": {b.function: b.module for b in self.bindings}, "ran": ran}


FAST_PACKAGES = ("fla",)  # causal_conv1d is optional: its torch path is one short convolution per layer


def kernels_in_use(model: torch.nn.Module) -> KernelReport:
    """What the model's modeling module binds, read from the closures of transformers' kernel wrappers: the
    choice each wrapper made at import and every forward uses."""
    bindings = []
    for name, cells in kernel_wrappers(model):
        implementation, package = _contents(cells["implementation"]), _contents(cells["package"])
        bindings.append(KernelBinding(name, package, _module_of(implementation)))
    return KernelReport(tuple(sorted(bindings, key=lambda b: b.function)))


class KernelRecorder:
    """While open, every kernel wrapper of ``model``'s modeling module notes what it calls, and from which kind
    of decoder layer (``layer_kinds[i]`` for layer i); ``report`` then holds the calls beside the bindings.
    It swaps the wrappers' closure cells while open, so open it where no other thread runs the model.
    """

    def __init__(self, model: torch.nn.Module, layer_kinds: Sequence[str]) -> None:
        self.model, self.layer_kinds = model, layer_kinds
        self.layer = -1  # the decoder layer running now
        self.calls: set[KernelBinding] = set()
        self._restore: list[tuple[CellType, object]] = []
        self._hooks: list = []

    def __enter__(self) -> KernelRecorder:
        for name, cells in kernel_wrappers(self.model):
            package = _contents(cells["package"])
            for cell in (cells["implementation"], cells["torch_function"]):
                original = _contents(cell)
                self._restore.append((cell, original))
                cell.cell_contents = self._recording(name, package, original)
        for i, layer in enumerate(self.model.model.layers):
            self._hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "layer", i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for cell, original in reversed(self._restore):
            cell.cell_contents = original
        for hook in self._hooks:
            hook.remove()
        self._restore, self._hooks = [], []

    def _recording(self, name: str, package: str, fn: Callable) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            kind = self.layer_kinds[self.layer] if self.layer >= 0 else "model"
            self.calls.add(KernelBinding(name, package, _module_of(fn), kind))
            return fn(*args, **kwargs)

        return call

    def report(self, bound: KernelReport) -> KernelReport:
        """``bound``'s bindings, with what ran while the recorder was open."""
        ran = sorted(self.calls, key=lambda c: (c.layer_kind, c.function, c.module))
        return KernelReport(bound.bindings, tuple(ran))


def require_fast(report: KernelReport, device: str, allow_slow: bool) -> None:
    """On CUDA, refuse the torch reference kernels (correct, far slower) unless they were asked for."""
    if device.startswith("cuda") and report.slow and not allow_slow:
        names = ", ".join(f"{b.function} ({b.module})" for b in report.slow)
        raise RuntimeError(
            f"flash-linear-attention is not in use on {device}: {names} fell back to torch; install the gpu "
            "extra (pip install -e '.[gpu]') or pass --allow-slow-kernels"
        )


def kernel_wrappers(model: torch.nn.Module) -> list[tuple[str, dict[str, CellType]]]:
    """(function name, closure cells) of every ``use_kernel_func_from_hub_with_fallback`` wrapper in the model's
    modeling module: the wrapper closes over ``implementation``, ``torch_function`` and ``package``."""
    module = sys.modules[type(model).__module__]
    found, seen = [], set()
    for value in vars(module).values():
        cells = _cells(_hub_function(value))
        if {"implementation", "torch_function", "package", "is_new_implementation"} <= cells.keys():
            if id(cells["implementation"]) in seen:  # one wrapper under two names
                continue
            seen.add(id(cells["implementation"]))
            implementation, package = _contents(cells["implementation"]), _contents(cells["package"])
            if callable(implementation) and isinstance(package, str):
                name = _contents(cells["func_name"]) if "func_name" in cells else getattr(value, "__name__", "?")
                found.append((str(name), cells))
    return found


def _module_of(fn: object) -> str:
    return str(getattr(fn, "__module__", "?"))


def _contents(cell: CellType) -> object:
    with contextlib.suppress(ValueError):  # an empty cell
        return cell.cell_contents
    return None


def _hub_function(value: object) -> object:
    """The function behind a module-level name: ``value`` itself, or, where the ``kernels`` package is
    installed, the one its hub layer calls (``use_kernel_forward_from_hub`` turns a decorated function
    into an ``nn.Module`` instance whose ``forward`` closes over it as ``func``)."""
    cell = _cells(getattr(type(value), "forward", None)).get("func")
    inner = _contents(cell) if cell is not None else None
    return inner if callable(inner) else value


def _cells(fn: object) -> dict[str, CellType]:
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not closure:
        return {}
    return dict(zip(code.co_freevars, closure))
