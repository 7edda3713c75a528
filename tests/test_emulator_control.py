"""The link emulator's control port as a hostile local user meets it, and its life as a child: real processes.

Only a holder of the cluster secret can drive it; a bad command is refused with an error reply and the
emulator goes on; a stall is bounded and ``stall 0`` ends it; routes lead only to the configured host;
and an emulator whose parent is killed with SIGKILL dies with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from test_emulator import echo_server

from minifaas.control.session import ControlError, connect
from minifaas.emulator.emulator_process import EmulatorError, EmulatorProcess

pytestmark = pytest.mark.timeout(120)
BAD_COMMANDS = [
    ({"cmd": "schedule", "steps": [[0, 0]]}, "rate in (0"),  # crashed the emulator: set_rate(0) in its TaskGroup
    ({"cmd": "stall", "seconds": 1e308}, "seconds must be"),  # stalled it for ever
    ({"cmd": "rate", "bps": 8}, None),  # a legal, if cruel, rate: accepted (the port is authenticated now)
    ({"cmd": "rate", "bps": 0}, "rate in (0"),
    ({"cmd": "rate", "bps": -1e9}, "rate in (0"),
    ({"cmd": "rate", "flow_bps": "fast"}, "rate in (0"),
    ({"cmd": "rate"}, "rate takes bps"),
    ({"cmd": "route", "target": "10.1.2.3:80"}, "routes lead only to 127.0.0.1"),  # an open relay before
    ({"cmd": "route", "target": "example.org:443"}, "routes lead only to 127.0.0.1"),
    ({"cmd": "route", "target": "127.0.0.1:99999"}, "not HOST:PORT"),
    ({"cmd": "unroute", "port": 1}, "no route listens"),
    ({"cmd": "delay", "ms": -5}, "ms must be"),
    ({"cmd": "delay", "ms": 5, "jitter_ms": 50}, "jitter_ms must be"),
    ({"cmd": "window", "bytes": 3}, "flow window"),
    ({"cmd": "schedule", "steps": [[5, 1e9], [1, 1e9]]}, "time order"),
    ({"cmd": "schedule", "steps": [[0, 1e9]] * 1001}, "1 to 1000"),
    ({"cmd": "schedule", "steps": "0:1gbit"}, "list of"),
    ({"cmd": "explode"}, "unknown command"),
]


def run(coro: object) -> object:
    return asyncio.run(asyncio.wait_for(coro, 90))  # type: ignore[arg-type]


async def round_trip(port: int, payload: bytes = b"ping") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    data = await asyncio.wait_for(reader.readexactly(len(payload)), 5)
    writer.close()
    return data


def test_only_a_holder_of_the_secret_drives_the_control_port() -> None:
    async def main() -> None:
        server = await echo_server()
        async with server, EmulatorProcess(server.sockets[0].getsockname()) as link:
            reader, writer = await asyncio.open_connection("127.0.0.1", link.control.port)
            writer.write(json.dumps({"cmd": "stall", "seconds": 60}).encode() + b"\n")  # the old JSON-lines way
            await writer.drain()
            said = await asyncio.wait_for(reader.read(), 15)  # the handshake's challenge, then closed: no reply
            assert b'"ok"' not in said and said.startswith(b"MFC")
            with pytest.raises(ControlError):
                await connect("127.0.0.1", link.control.port, b"x" * 32, timeout=5)
            assert (await link.control.stats())["stalled"] is False
            assert await round_trip(link.port) == b"ping"

    run(main())


def test_a_ping_behind_an_unanswered_command_fails_at_its_own_deadline() -> None:
    """A hung emulator answers neither the command ahead of a ping nor the ping: the ping's deadline counts
    from when it is asked, not from when the command ahead gives up."""

    async def main() -> None:
        server = await echo_server()
        async with server, EmulatorProcess(server.sockets[0].getsockname()) as link:
            await link.control.stats()  # the session is open
            os.kill(link.pid, signal.SIGSTOP)
            try:
                ended: list[str] = []

                async def ask(name: str, call: object) -> None:
                    with contextlib.suppress(EmulatorError):
                        await call  # type: ignore[misc]
                    ended.append(name)

                ahead = asyncio.ensure_future(ask("stats", link.control.command("stats", timeout=6.0)))
                await asyncio.sleep(0.2)  # the stats command holds the session
                await ask("ping", link.control.ping(1.0))
                assert ended == ["ping"]  # the ping gave up while the stats command still waited
                await ahead
            finally:
                os.kill(link.pid, signal.SIGCONT)

    run(main())


def test_a_bad_command_is_refused_and_the_emulator_survives_it() -> None:
    async def main() -> None:
        server = await echo_server()
        async with server, EmulatorProcess(server.sockets[0].getsockname(), rate="1gbit") as link:
            for request, error in BAD_COMMANDS:
                if error is None:
                    await link.control.command(**request)
                    continue
                with pytest.raises(EmulatorError, match=error.replace("(", r"\(")):
                    await link.control.command(**request)
            await link.control.set_rate(1e9)
            stats = await link.control.stats()
            target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
            assert stats["rate_bps"] == 1e9 and stats["routes"] == {str(link.port): target}  # no route was added
            assert link.alive and await round_trip(link.port) == b"ping"

    run(main())


def test_a_gateways_emulator_leaves_a_terminals_ctrl_c_to_the_gateway() -> None:
    """^C reaches every process of the terminal's group: the gateway's emulators must outlive it, since the
    gateway still needs its link while it stops its workers (then it closes their stdin)."""

    async def main() -> None:
        server = await echo_server()
        async with server, EmulatorProcess(server.sockets[0].getsockname()) as link:
            os.kill(link.pid, signal.SIGINT)
            await asyncio.sleep(0.5)
            assert link.alive and await round_trip(link.port) == b"ping"

    run(main())


def test_a_stall_is_bounded_and_stall_zero_ends_it() -> None:
    async def main() -> None:
        server = await echo_server()
        async with server, EmulatorProcess(server.sockets[0].getsockname()) as link:
            await link.control.stall(300)
            flowing = asyncio.create_task(round_trip(link.port))
            await asyncio.sleep(0.5)
            assert not flowing.done()  # stalled
            start = time.monotonic()
            await link.control.stall(0)
            assert await asyncio.wait_for(flowing, 5) == b"ping"
            assert time.monotonic() - start < 2  # the waiting flow woke at once, not at the old stall's end
            assert (await link.control.stats())["stalled"] is False

    run(main())


PARENT = """
import asyncio, os, sys
from minifaas.emulator.emulator_process import EmulatorProcess
async def main():
    async with EmulatorProcess(("127.0.0.1", 9)) as link:
        print(link.pid, flush=True)
        await asyncio.sleep(600)
asyncio.run(main())
"""


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_an_emulator_dies_with_its_parent_however_the_parent_dies(stopped: bool) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())  # type: ignore[union-attr]
    if stopped:  # a stopped child ignores its stdin closing; the parent-death signal still kills it
        os.kill(pid, signal.SIGSTOP)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running(pid):
        time.sleep(0.05)
    assert not running(pid), f"emulator {pid} outlived its parent"


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_the_link_emulator_command_relays_between_ipv6_hosts() -> None:
    """``minifaas link-emulator --target [::1]:PORT --listen [::1]:0``: both ends on IPv6 loopback."""
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")

    async def main() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.read(100))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, "::1", 0)
        port = server.sockets[0].getsockname()[1]
        env = {**os.environ, "MINIFAAS_SECRET": "a-secret-of-twenty-four-bytes"}
        argv = [sys.executable, "-m", "minifaas.commands.main", "link-emulator", "--target", f"[::1]:{port}",
                "--listen", "[::1]:0"]  # fmt: skip
        emulator = await asyncio.create_subprocess_exec(*argv, env=env, stdout=subprocess.PIPE)
        try:
            assert emulator.stdout is not None
            relay = json.loads(await asyncio.wait_for(emulator.stdout.readline(), 60))["port"]
            reader, writer = await asyncio.open_connection("::1", relay)
            writer.write(b"over six")
            assert await asyncio.wait_for(reader.read(100), 10) == b"over six"
            writer.close()
        finally:
            emulator.terminate()
            await emulator.wait()
            server.close()

    run(main())
