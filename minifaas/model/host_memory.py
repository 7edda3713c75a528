"""Host memory for a process that runs forwards: freed blocks are kept for the next forward.

A forward on the CPU frees its activations, and the next asks for the same sizes again. Under glibc's defaults
every block above the mmap threshold is a fresh ``mmap``, unmapped on free, and the heap's free top goes back to
the kernel past the trim threshold, so each forward faults its pages in anew. ``keep_freed_memory`` sets both
thresholds once per process, before the model loads (``ModelRuntime.load`` calls it): blocks up to
``MMAP_THRESHOLD`` come from the heap, which keeps up to ``TRIM_THRESHOLD`` free. Resident memory then stays at
its peak. Only glibc has these knobs; elsewhere, and with ``MINIFAAS_HOST_MALLOC=system``, nothing changes.
``available_bytes`` is what the host can still give, for the bounds sized by memory (admission, decode rows).
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


def available_bytes() -> int:
    """Host memory a new allocation can still get: MemAvailable on Linux, else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
