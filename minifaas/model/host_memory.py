"""Host memory for a process that runs forwards: freed blocks are kept for the next forward.

A forward on the CPU allocates its activations and frees them again, and the
next forward asks for the same sizes. glibc serves every block above its mmap
threshold (128 KiB at first; it rises as such blocks are freed, up to 32 MiB)
with a fresh ``mmap`` and unmaps it on free, and it hands the top of its heap
back to the kernel once more than its trim threshold is free there. Each
forward then touches pages the kernel must map and zero again: a 128-token
prefill of kimi-linear-tiny took 25,800 page faults and about a third of its
time for them (docs/RESULTS.md, section 29).

``keep_freed_memory`` sets both thresholds once per process, before the model
loads (``ModelRuntime.load`` calls it): blocks up to ``MMAP_THRESHOLD`` come
from the heap, and the heap keeps up to ``TRIM_THRESHOLD`` of free memory
for the next forward. The price is resident memory that stays at its peak,
as a serving process's does anyway. Only glibc has these knobs; elsewhere, and
with ``MINIFAAS_HOST_MALLOC=system`` in the environment, nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its threshold on 64-bit hosts
TRIM_THRESHOLD = 1 << 30
ENV = "MINIFAAS_HOST_MALLOC"  # "system": leave the C library's own settings
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Keep freed host memory for the next forward (see the module docstring). True when set, in this
    call or an earlier one; False where the C library is not glibc or ``MINIFAAS_HOST_MALLOC=system``."""
    global _done
    if _done is None:
        _done = _set()
    return _done


def _set() -> bool:
    if os.environ.get(ENV, "").strip().lower() == "system" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
