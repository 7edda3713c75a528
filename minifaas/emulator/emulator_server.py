"""The cross-datacenter link emulator: a TCP relay process that every inter-cluster connection crosses.

    minifaas link-emulator --target 127.0.0.1:9000 --rate 1gbit --flow-rate 250mbit --window 4MiB \
        --delay-ms 15 --jitter-ms 1 --schedule 0:1gbit,30:200mbit

It prints ``{"port": ..., "control_port": ...}`` as one JSON line once it listens. Each control message is one
command ``{"cmd": NAME, ...}``, answered ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}`` with the
request's "id": stats | cut (reset every connection) | stall seconds (forward nothing; 0 ends it) | corrupt (flip
a byte of the next chunk to the target) | rate bps, flow_bps (null: unlimited) | window bytes (per flow; null:
none) | delay ms, jitter_ms | schedule steps [[seconds, bps], ...] | route target -> port | unroute port | ping.
"""

from __future__ import annotations

import asyncio
import json
import signal

from minifaas.control.server import ControlServer
from minifaas.control.session import Session
from minifaas.emulator.link_commands import CommandError, apply_command
from minifaas.emulator.relay import LinkEmulator, RelayConfig
from minifaas.parent_watch import exit_when_stdin_closes
from minifaas.proctitle import set_title


async def _control_session(link: LinkEmulator, route_hosts: frozenset[str], session: Session, idle_s: float) -> None:
    """Answer one authenticated client's commands; a bad one gets an error reply, and the session goes on."""
    while (request := await session.recv(idle_s)) is not None:
        try:
            reply = {"ok": True, **apply_command(link, request, route_hosts)}
        except CommandError as e:
            reply = {"ok": False, "error": str(e)}
        if "id" in request:
            reply["id"] = request["id"]
        session.send(reply)
        await session.drain(idle_s)


async def serve_link(
    config: RelayConfig, secret: bytes, control: tuple[str, int], route_hosts: frozenset[str], idle_s: float,
    exit_with_stdin: bool,
) -> int:  # fmt: skip
    """Relay and answer the control port until SIGINT or SIGTERM; with ``exit_with_stdin`` (a gateway's child)
    until SIGTERM or stdin closes: a terminal's ^C is the gateway's to handle, which stops its emulators last."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if exit_with_stdin:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM,) if exit_with_stdin else (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with LinkEmulator(config) as link, asyncio.TaskGroup() as tg:
        handler = lambda session: _control_session(link, route_hosts, session, idle_s)  # noqa: E731
        async with ControlServer(control, secret, handler, deadline_s=idle_s) as server:
            print(json.dumps({"port": link.port, "control_port": server.port}), flush=True)
            set_title("link-emulator", f":{link.port}", "->", f"{config.target_host}:{config.target_port}")
            watching = tg.create_task(exit_when_stdin_closes()) if exit_with_stdin else None
            await stop.wait()
            if watching is not None:
                watching.cancel()
    return 0
