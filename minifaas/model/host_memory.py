"""Host memory for a process that runs forwards: freed blocks are kept for the next forward.

``keep_freed_memory`` raises glibc's mmap and trim thresholds once per process, before the model loads, so a
forward on the CPU reuses freed heap blocks instead of faulting fresh pages in (without glibc, or with
``MINIFAAS_HOST_MALLOC=system``, nothing changes). ``available_bytes`` is what the host can still give.
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
