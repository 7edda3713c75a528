"""The cross-datacenter link emulator: a TCP relay process that every inter-cluster connection crosses.

    python -m minifaas.commands.link_emulator --target 127.0.0.1:9000 --rate 1gbit \\
        --flow-rate 250mbit --window 4MiB --delay-ms 15 --jitter-ms 1 --schedule 0:1gbit,30:200mbit
    minifaas link-emulator ...   (the same)

The link itself (one aggregate pacer shared by all flows, an optional
per-flow cap and per-flow window, delay, jitter, faults) is
``relay.LinkEmulator``; this module is the process around it: a
control port and a clean stop (its flags: ``commands/link_emulator.py``). The round trip is twice ``--delay-ms``.

On start it prints one JSON line, ``{"port": ..., "control_port": ...}``, then
serves until SIGINT/SIGTERM. The control port takes one JSON object per line
and answers one per line (see ``EmulatorControl``):

    {"cmd": "stats"}                      bytes, flows, rates, utilisation since the last stats
    {"cmd": "cut"}                        reset every connection now
    {"cmd": "stall", "seconds": 2.5}      forward nothing for that long
    {"cmd": "corrupt"}                    flip one byte in the next forwarded chunk (towards the target)
    {"cmd": "rate", "bps": 1e9}           aggregate rate (null: unlimited); also "flow_bps"
    {"cmd": "window", "bytes": 4194304}   bytes in flight per flow (null: no window)
    {"cmd": "delay", "ms": 10, "jitter_ms": 1}
    {"cmd": "schedule", "steps": [[0, 1e9], [5, 1e8]]}   rates from now on
    {"cmd": "route", "target": "127.0.0.1:9001"}   one more target over the same link: {"port": ...}
    {"cmd": "unroute", "port": 40123}     stop taking new flows on that port
    {"cmd": "ping"}                       {} at once: the gateway's heartbeat

The control port speaks the workers' control protocol (``control.session``):
a client proves the cluster secret ($MINIFAAS_SECRET or ``--secret-file``)
and then sends signed frames; one client at a time, at most a few in the
handshake, and a client silent for ``--control-idle`` seconds is dropped.
Every command is validated first (``emulator_commands``): a bad one is
refused with ``{"ok": false, "error": ...}`` and the emulator goes on. With
``--exit-with-stdin`` (how the gateway starts it) it exits when its stdin
closes, and the kernel kills it when its parent dies
(``minifaas.parent_watch``).
"""

from __future__ import annotations

import asyncio
import json
import signal

from minifaas.control.server import ControlServer
from minifaas.control.session import Session
from minifaas.emulator.link_commands import CommandError, apply_command
from minifaas.emulator.relay import LinkConfig, LinkEmulator
from minifaas.parent_watch import exit_when_stdin_closes


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


async def serve(
    config: LinkConfig, secret: bytes, control: tuple[str, int], route_hosts: frozenset[str], idle_s: float,
    exit_with_stdin: bool,
) -> int:  # fmt: skip
    """Relay and answer the control port until SIGINT or SIGTERM (or stdin closes, with ``exit_with_stdin``)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with LinkEmulator(config) as link, asyncio.TaskGroup() as tg:
        handler = lambda session: _control_session(link, route_hosts, session, idle_s)  # noqa: E731
        async with ControlServer(control, secret, handler, deadline_s=idle_s) as server:
            print(json.dumps({"port": link.port, "control_port": server.port}), flush=True)
            watching = tg.create_task(exit_when_stdin_closes()) if exit_with_stdin else None
            await stop.wait()
            if watching is not None:
                watching.cancel()
    return 0
