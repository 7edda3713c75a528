"""Ending a child process: give it a grace period to exit, then kill it, so no caller hangs on a stuck child."""

from __future__ import annotations

import asyncio
import signal


async def wait_or_kill(process: asyncio.subprocess.Process, grace: float) -> bool:
    """Wait up to ``grace`` seconds for ``process`` to exit; kill it if it has not (then True)."""
    try:
        async with asyncio.timeout(grace):
            await process.wait()
    except TimeoutError:
        process.kill()
        await process.wait()
        return True
    return False


def describe_exit(returncode: int | None) -> str:
    """How a process ended, for a log line: "exit code 1", "killed by SIGKILL"."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
