"""Keep flash-linear-attention out of CPU processes.

transformers decides once, when a modeling module is first imported, whether to
use fla's Triton kernels: it tries ``import fla`` and keeps what it finds. On a
machine without a GPU those kernels fail at the first forward ("0 active
drivers"), or, where transformers' wrapper routes by the inputs' device, are
skipped for the torch reference while fla still reads as bound. So a CPU process
makes ``import fla`` fail *before* transformers loads any model code. A CUDA
process leaves it alone and gets the fast kernels, if fla imports: transformers
swallows an import error and binds the torch reference instead, so
``kernels_in_use`` reads back what each function is bound to, and a CUDA worker
refuses the reference unless told otherwise (``require_fast``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass
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
    return "torch"


@dataclass(frozen=True, slots=True)
class KernelBinding:
    """One function a modeling module routes to an optional package: which one it really calls."""

    function: str  # the name transformers looks up, e.g. "chunk_gated_delta_rule"
    package: str  # the package it prefers, e.g. "fla"
    module: str  # where the function in use lives: the package's module, or transformers' own (the fallback)

    @property
    def fast(self) -> bool:
        return self.module.split(".")[0] == self.package


@dataclass(frozen=True, slots=True)
class KernelReport:
    bindings: tuple[KernelBinding, ...]

    @property
    def slow(self) -> tuple[KernelBinding, ...]:
        """Bindings to a fast-path package (fla) that fell back to the torch reference."""
        return tuple(b for b in self.bindings if b.package in FAST_PACKAGES and not b.fast)

    @property
    def label(self) -> str:
        """ "fla": every fla function bound to fla; "torch": some fell back; "none": the model needs none."""
        if not any(b.package in FAST_PACKAGES for b in self.bindings):
            return "none"
        return "torch" if self.slow else "fla"

    def to_json(self) -> dict:
        return {"kernels": self.label, "bindings": {b.function: b.module for b in self.bindings}}


FAST_PACKAGES = ("fla",)  # causal_conv1d is optional: its torch path is one short convolution per layer


def kernels_in_use(model: torch.nn.Module) -> KernelReport:
    """What the model's modeling module actually calls, read from transformers' kernel wrappers.

    ``use_kernel_func_from_hub_with_fallback`` resolves each function once, at import, and keeps the
    choice in the wrapper's closure (``implementation``, with ``package`` beside it): that is the
    binding every forward uses, so reading it is checking the kernels, not guessing from imports.
    """
    module = sys.modules[type(model).__module__]
    bindings = []
    for value in vars(module).values():
        cells = _closure(_hub_function(value))
        implementation, package = cells.get("implementation"), cells.get("package")
        if callable(implementation) and isinstance(package, str) and "is_new_implementation" in cells:
            name = str(cells.get("func_name", getattr(value, "__name__", "?")))
            bindings.append(KernelBinding(name, package, str(getattr(implementation, "__module__", "?"))))
    return KernelReport(tuple(sorted(bindings, key=lambda b: b.function)))


def require_fast(report: KernelReport, device: str, allow_slow: bool) -> None:
    """On CUDA, refuse the torch reference kernels (correct, far slower) unless they were asked for."""
    if device.startswith("cuda") and report.slow and not allow_slow:
        names = ", ".join(f"{b.function} ({b.module})" for b in report.slow)
        raise RuntimeError(
            f"flash-linear-attention is not in use on {device}: {names} fell back to torch; install the gpu "
            "extra (pip install -e '.[gpu]') or pass --allow-slow-kernels"
        )


def _hub_function(value: object) -> object:
    """The function behind a module-level name: ``value`` itself, or, where the ``kernels`` package is
    installed, the one its hub layer calls (``use_kernel_forward_from_hub`` turns a decorated function
    into an ``nn.Module`` instance whose ``forward`` closes over it as ``func``)."""
    inner = _closure(getattr(type(value), "forward", None)).get("func")
    return inner if callable(inner) else value


def _closure(fn: object) -> dict[str, object]:
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not closure:
        return {}
    cells = {}
    for name, cell in zip(code.co_freevars, closure):
        with contextlib.suppress(ValueError):  # an empty cell
            cells[name] = cell.cell_contents
    return cells
