"""A child that ends with its parent, however the parent ends (kill -9 included).

The gateway starts each child with a pipe on its stdin and its pid in the environment (``child_env``). The
child calls ``die_with_parent`` (the kernel kills it when its parent dies) and ``exit_when_stdin_closes`` (the
portable guard). A worker forked by the pre-loaded parent outlives that parent, but not the gateway.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys

PARENT_ENV = "MINIFAAS_PARENT_PID"
GATEWAY_ENV = "MINIFAAS_GATEWAY_PID"  # set for a worker whose parent is the pre-loaded one, not the gateway
PR_SET_PDEATHSIG = 1
PARENT_GONE = signal.SIGUSR2  # what a forked worker gets when the pre-loaded parent dies

log = logging.getLogger("minifaas")


def child_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that must not outlive this process."""
    inherited = {k: v for k, v in (os.environ if environ is None else environ).items() if k != GATEWAY_ENV}
    return {**inherited, PARENT_ENV: str(os.getpid())}


def die_with_parent() -> bool:
    """Be killed when the parent named in $MINIFAAS_PARENT_PID dies; False when there is none to watch."""
    parent = os.environ.get(PARENT_ENV, "")
    if not parent.isdigit():
        return False
    gateway = os.environ.get(GATEWAY_ENV, "")
    if gateway.isdigit():  # the parent is the pre-loaded one: outlive it, not the gateway
        signal.signal(PARENT_GONE, lambda signum, frame: None if running(int(gateway)) else os._exit(1))
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        deathsig = PARENT_GONE if gateway.isdigit() else signal.SIGKILL
        if libc.prctl(PR_SET_PDEATHSIG, deathsig, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    if os.getppid() != int(parent) and not (gateway.isdigit() and running(int(gateway))):
        os._exit(1)  # it died before the prctl took effect
    return True


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(") ")[2][:1] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
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
