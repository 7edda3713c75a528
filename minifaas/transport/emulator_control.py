"""Driving a link emulator process: start it, learn its ports, send it commands.

    async with EmulatorProcess(target=("127.0.0.1", rx.port), rate="1gbit", delay_ms=5) as link:
        sender = KVSender(SenderConfig("127.0.0.1", link.port, secret))
        await link.control.stall(2.0)
        print(await link.control.stats())

``EmulatorProcess`` runs ``python -m minifaas.transport.emulator`` as a child
process and always stops it on exit (SIGTERM, then SIGKILL). ``EmulatorControl``
speaks the control port's JSON lines; use it alone for an emulator started
elsewhere (by the cluster launcher).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from minifaas.child_process import wait_or_kill


class EmulatorError(RuntimeError):
    """The emulator did not start, or refused a command."""


class EmulatorControl:
    def __init__(self, host: str, port: int, timeout: float = 5.0):
        self.host, self.port, self.timeout = host, port, timeout

    async def command(self, cmd: str, **args: Any) -> dict[str, Any]:
        async with asyncio.timeout(self.timeout):
            reader, writer = await asyncio.open_connection(self.host, self.port)
            try:
                writer.write(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
                await writer.drain()
                reply = json.loads(await reader.readline())
            finally:
                writer.close()
        if not reply.pop("ok", False):
            raise EmulatorError(reply.get("error", "no reason given"))
        return reply

    async def stats(self) -> dict[str, Any]:
        return await self.command("stats")

    async def cut(self) -> None:
        await self.command("cut")

    async def stall(self, seconds: float) -> None:
        await self.command("stall", seconds=seconds)

    async def corrupt(self) -> None:
        await self.command("corrupt")

    async def set_rate(self, bps: float | None) -> None:
        await self.command("rate", bps=bps)

    async def set_flow_rate(self, bps: float | None) -> None:
        await self.command("rate", flow_bps=bps)

    async def set_window(self, nbytes: int | None) -> None:
        """Bytes in flight per flow (None: no window); running flows take it at once."""
        await self.command("window", bytes=nbytes)

    async def set_delay(self, ms: float, jitter_ms: float = 0.0) -> None:
        await self.command("delay", ms=ms, jitter_ms=jitter_ms)

    async def schedule(self, steps: list[tuple[float, float | None]]) -> None:
        await self.command("schedule", steps=[list(s) for s in steps])

    async def add_route(self, target: tuple[str, int]) -> int:
        """Another target behind the same link; returns the port senders use for it."""
        return int((await self.command("route", target=f"{target[0]}:{target[1]}"))["port"])

    async def remove_route(self, port: int) -> None:
        await self.command("unroute", port=port)


class EmulatorProcess:
    def __init__(self, target: tuple[str, int], start_timeout: float = 30.0, **options: Any):
        """``options``: rate, flow_rate, window, delay_ms, jitter_ms, schedule, read_bytes, seed (as on the
        command line)."""
        self.target = target
        self.options = options
        self.start_timeout = start_timeout
        self.port = 0
        self.control = EmulatorControl("127.0.0.1", 0)
        self._process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> EmulatorProcess:
        argv = [sys.executable, "-m", "minifaas.transport.emulator", "--target", f"{self.target[0]}:{self.target[1]}"]
        for key, value in self.options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        self._process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
        try:
            async with asyncio.timeout(self.start_timeout):
                line = await self._process.stdout.readline()  # type: ignore[union-attr]
            ready = json.loads(line)
        except (TimeoutError, json.JSONDecodeError) as e:
            await self._stop()
            raise EmulatorError(f"the emulator did not start: {e!r}") from None
        self.port = ready["port"]
        self.control = EmulatorControl("127.0.0.1", ready["control_port"])
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stop()

    async def _stop(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        await wait_or_kill(process, grace=10)
