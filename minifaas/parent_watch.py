"""A child that ends with its parent, however the parent ends (kill -9 included).

The gateway starts every worker and link emulator with a pipe on its stdin
and ``MINIFAAS_PARENT_PID`` in its environment (``child_env``). The child
calls ``die_with_parent`` as it starts: PR_SET_PDEATHSIG (Linux, through
ctypes prctl) makes the kernel SIGKILL it the moment its parent dies, even
while it is stopped (SIGSTOP) or stuck in a forward; a parent that died
before the call is caught by comparing getppid with the pid it was given.
``exit_when_stdin_closes`` is the second, portable guard: the pipe closes when
the parent goes, on any system.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys

PARENT_ENV = "MINIFAAS_PARENT_PID"
PR_SET_PDEATHSIG = 1

log = logging.getLogger("minifaas")


def child_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that must not outlive this process."""
    return {**(os.environ if environ is None else environ), PARENT_ENV: str(os.getpid())}


def die_with_parent() -> bool:
    """Be killed when the parent named in $MINIFAAS_PARENT_PID dies; False when there is none to watch."""
    parent = os.environ.get(PARENT_ENV, "")
    if not parent.isdigit():
        return False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    if os.getppid() != int(parent):  # it died before the prctl took effect
        os._exit(1)
    return True


async def exit_when_stdin_closes() -> None:
    """Return never: exit the process at once when stdin reaches its end."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass
    log.info("parent gone: exiting")
    os._exit(0)  # at once: a forward still running in its thread would hold up a clean exit
