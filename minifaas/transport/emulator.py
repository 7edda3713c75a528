"""The cross-datacenter link emulator: a TCP relay process that every inter-cluster connection crosses.

    python -m minifaas.transport.emulator --target 127.0.0.1:9000 --rate 1gbit \\
        --flow-rate 250mbit --window 4MiB --delay-ms 15 --jitter-ms 1 --schedule 0:1gbit,30:200mbit
    minifaas link-emulator ...   (the same)

The link itself (one aggregate pacer shared by all flows, an optional
per-flow cap and per-flow window, delay, jitter, faults) is
``relay.LinkEmulator``; this module is the process around it: flags, a
control port, a clean stop. The round trip is twice ``--delay-ms``.

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

import argparse
import asyncio
import json
import signal
import sys

from minifaas import arguments
from minifaas.cli import user_input
from minifaas.control.secret import load_secret
from minifaas.control.server import ControlServer
from minifaas.control.session import Session
from minifaas.parent_watch import die_with_parent, exit_when_stdin_closes
from minifaas.transport.emulator_commands import CommandError, apply_command
from minifaas.transport.pacer import RateSchedule, parse_bytes, parse_rate
from minifaas.transport.relay import LinkConfig, LinkEmulator


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", type=arguments.address, required=True, help="HOST:PORT the relay forwards to (the receiver)"
    )
    parser.add_argument(
        "--listen", type=arguments.address, default="127.0.0.1:0", help="HOST:PORT for senders (port 0: any)"
    )
    parser.add_argument(
        "--control", type=arguments.address, default="127.0.0.1:0", help="HOST:PORT of the JSON-lines control port"
    )
    parser.add_argument("--rate", type=arguments.rate, default="none", help="aggregate rate per direction, e.g. 1gbit")
    parser.add_argument("--flow-rate", type=arguments.rate, default="none", help="cap of one flow, e.g. 250mbit")
    parser.add_argument("--window", type=arguments.window, default="none", help="bytes in flight per flow, e.g. 4MiB")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (the RTT is twice it)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform +- jitter on the delay")
    parser.add_argument(
        "--schedule",
        type=arguments.rate_schedule,
        default="",
        help="rate steps SECONDS:RATE,..., e.g. 0:1gbit,10:100mbit (default: none)",
    )
    parser.add_argument("--read-bytes", type=int, default=1 << 20, help="relay read size")
    parser.add_argument("--seed", type=int, default=0, help="jitter seed")
    parser.add_argument("--splice", choices=("on", "off"), default="on",
                        help="move bytes with splice(2) (off: copy them through the relay)")  # fmt: skip
    parser.add_argument(
        "--secret-file", default=None, help="the cluster secret for the control port (default: $MINIFAAS_SECRET)"
    )
    parser.add_argument(
        "--route-host", action="append", default=None,
        help="a host the route command may lead to (repeatable; default: the --target's host)",
    )  # fmt: skip
    parser.add_argument(
        "--control-idle", type=float, default=30.0, help="drop a control client silent this long, seconds"
    )
    parser.add_argument("--exit-with-stdin", action="store_true", help="exit when stdin closes (the gateway's)")


def run(args: argparse.Namespace) -> int:
    (target_host, target_port), listen = args.target, args.listen
    with user_input():
        secret = load_secret(args.secret_file)
        if not args.control_idle > 0:
            raise ValueError(f"--control-idle must be > 0, got {args.control_idle}")
        config = LinkConfig(
            target_host, target_port, listen[0], listen[1], parse_rate(args.rate), parse_rate(args.flow_rate),
            parse_bytes(args.window), args.delay_ms, args.jitter_ms, RateSchedule.parse(args.schedule),
            args.read_bytes, args.seed, args.splice == "on",
        )  # fmt: skip
    die_with_parent()
    return asyncio.run(_serve(config, args, secret))


async def _serve(config: LinkConfig, args: argparse.Namespace, secret: bytes) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    route_hosts = frozenset(args.route_host or [config.target_host])
    async with LinkEmulator(config) as link, asyncio.TaskGroup() as tg:
        idle = args.control_idle
        handler = lambda session: _control_session(link, route_hosts, session, idle)  # noqa: E731
        async with ControlServer(args.control, secret, handler, deadline_s=idle) as server:
            print(json.dumps({"port": link.port, "control_port": server.port}), flush=True)
            watching = tg.create_task(exit_when_stdin_closes()) if args.exit_with_stdin else None
            await stop.wait()
            if watching is not None:
                watching.cancel()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m minifaas.transport.emulator", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
