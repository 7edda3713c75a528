"""Driving a link emulator process: start it, learn its ports, send it commands, restart it.

    async with EmulatorProcess(target=("127.0.0.1", rx.port), rate="1gbit", delay_ms=5) as link:
        sender = KVSender(SenderConfig("127.0.0.1", link.port, secret))
        await link.control.stall(2.0)
        print(await link.control.stats())

``EmulatorProcess`` runs the emulator as a child that dies with this process; ``EmulatorControl`` alone drives
one started elsewhere, one command at a time over an authenticated control session.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

from minifaas.child_process import wait_or_kill
from minifaas.control.secret import SECRET_ENV, new_secret
from minifaas.control.session import ControlError, Session, connect
from minifaas.parent_watch import child_env


class EmulatorError(RuntimeError):
    """The emulator did not start, or refused a command."""


class EmulatorControl:
    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 5.0):
        self.host, self.port, self.secret, self.timeout = host, port, secret, timeout
        self._session: Session | None = None
        self._lock = asyncio.Lock()  # one command on the session at a time: replies come in order

    async def command(self, cmd: str, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one command and return its reply; EmulatorError if refused, unanswered within ``timeout``
        (default: the control's, counted from the call: a wait for the command ahead counts) or the session
        failed."""
        holding = False
        try:
            async with asyncio.timeout(timeout or self.timeout):
                await self._lock.acquire()
                holding = True
                if self._session is None or self._session.closed:
                    self._session = await connect(self.host, self.port, self.secret, timeout or self.timeout)
                self._session.send({"cmd": cmd, **args})
                await self._session.drain()
                reply = await self._session.recv()
        except (TimeoutError, ControlError, OSError) as e:
            if holding:
                self.close()  # a late reply would be taken for the next command's: start afresh
            raise EmulatorError(f"the emulator at {self.host}:{self.port} did not answer {cmd}: {e!r}") from None
        finally:
            if holding:
                self._lock.release()
        if reply is None:
            self.close()
            raise EmulatorError(f"the emulator at {self.host}:{self.port} closed the session")
        if not reply.pop("ok", False):
            raise EmulatorError(reply.get("error", "no reason given"))
        return reply

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    async def ping(self, timeout: float) -> None:
        await self.command("ping", timeout=timeout)

    async def stats(self) -> dict[str, Any]:
        return await self.command("stats")

    async def cut(self) -> None:
        await self.command("cut")

    async def stall(self, seconds: float) -> None:
        await self.command("stall", seconds=seconds)

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
    def __init__(
        self, target: tuple[str, int], start_timeout: float = 30.0, secret: bytes | None = None, **options: Any
    ):
        """``options``: rate, flow_rate, window, delay_ms, jitter_ms, schedule, read_bytes, seed (as on the
        command line)."""
        self.target = target
        self.options = options
        self.start_timeout = start_timeout
        self.secret = secret or new_secret()
        self.port = 0
        self.control = EmulatorControl("127.0.0.1", 0, self.secret)
        self.routes: dict[tuple[str, int], int] = {}  # target -> the port its flows come in on (not the first)
        self.restarts = 0
        self._process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        return self._process.pid if self._process is not None else 0

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def exited(self) -> None:
        """Return when the process has ended (at once if there is none)."""
        if self._process is not None:
            await self._process.wait()

    async def __aenter__(self) -> EmulatorProcess:
        await self._start(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.control.close()
        await self._stop()

    async def _start(self, port: int) -> None:
        argv = [
            sys.executable,
            "-m",
            "minifaas.commands.link_emulator",
            "--target",
            f"{self.target[0]}:{self.target[1]}",
        ]
        argv += ["--listen", f"127.0.0.1:{port}", "--exit-with-stdin"]
        for key, value in self.options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        env = child_env({**os.environ, SECRET_ENV: self.secret.decode()})
        self._process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env
        )
        try:
            async with asyncio.timeout(self.start_timeout):
                line = await self._process.stdout.readline()  # type: ignore[union-attr]
            if not line:  # its error went to the shared terminal
                code = await self._process.wait()
                raise EmulatorError(f"the link emulator exited before it was ready (exit code {code})")
            ready = json.loads(line)
        except (TimeoutError, json.JSONDecodeError) as e:
            await self._stop()
            raise EmulatorError(f"the link emulator did not start: {e!r}") from None
        self.port = ready["port"]
        self.control.close()
        self.control = EmulatorControl("127.0.0.1", ready["control_port"], self.secret)

    async def add_route(self, target: tuple[str, int]) -> int:
        """Another target behind the same link, remembered for a restart; returns the port senders use."""
        self.routes[target] = await self.control.add_route(target)
        return self.routes[target]

    async def remove_route(self, target: tuple[str, int]) -> None:
        port = self.routes.pop(target, None)
        if port is not None:
            await self.control.remove_route(port)

    async def restart(self) -> None:
        """Replace the process (dead, or alive but not answering) with a fresh one on the same port; the
        routes come back on new ports (``routes``). Its settings are the command line's, not later commands'."""
        if self.alive:
            self._process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]  # a stopped one ignores SIGTERM
            await self._process.wait()  # type: ignore[union-attr]
        await self._start(self.port)
        for target in list(self.routes):
            self.routes[target] = await self.control.add_route(target)
        self.restarts += 1

    async def _stop(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        process.terminate()
        await wait_or_kill(process, grace=10)
