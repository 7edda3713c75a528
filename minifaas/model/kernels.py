"""Keep flash-linear-attention out of CPU processes.

transformers decides once, when a modeling module is first imported, whether to
use fla's Triton kernels: it tries ``import fla`` and keeps what it finds. On a
machine without a GPU those kernels fail at the first forward ("0 active
drivers"), so a CPU process must make ``import fla`` fail *before* transformers
loads any model code. A CUDA process leaves it alone and gets the fast kernels.
"""

from __future__ import annotations

import logging
import sys

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
