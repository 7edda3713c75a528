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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any

from minifaas import arguments
from minifaas.cli import user_input
from minifaas.transport.pacer import RateSchedule, parse_bytes, parse_rate
from minifaas.transport.relay import LinkConfig, LinkEmulator


def apply_command(link: LinkEmulator, request: dict[str, Any]) -> dict[str, Any]:
    """One control-port command; raises ValueError/KeyError/TypeError on a bad one."""
    cmd = request.get("cmd")
    if cmd == "stats":
        return link.stats()
    if cmd == "cut":
        link.cut()
    elif cmd == "stall":
        link.stall(float(request["seconds"]))
    elif cmd == "corrupt":
        link.corrupt_pending += 1
    elif cmd == "rate":
        if "bps" in request:
            link.set_rate(request["bps"])
        if "flow_bps" in request:
            link.set_flow_rate(request["flow_bps"])
    elif cmd == "window":
        link.set_window(request["bytes"])
    elif cmd == "delay":
        link.set_delay(float(request["ms"]), float(request.get("jitter_ms", 0)))
    elif cmd == "route":
        host, port = _address(str(request["target"]))
        return {"port": link.add_route(host, port)}
    elif cmd == "unroute":
        link.remove_route(int(request["port"]))
    elif cmd == "schedule":
        link.set_schedule(RateSchedule(tuple((float(t), r) for t, r in request["steps"])))
    else:
        raise ValueError(f"unknown command {cmd!r}")
    return {}


async def _control_session(link: LinkEmulator, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while line := await reader.readline():
            try:
                reply = {"ok": True, **apply_command(link, json.loads(line))}
            except (ValueError, KeyError, TypeError) as e:
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):  # a client gone, or the emulator stopping
        pass
    finally:
        writer.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"not HOST:PORT: {text!r}")
    return host or "127.0.0.1", int(port)


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


def run(args: argparse.Namespace) -> int:
    (target_host, target_port), listen = args.target, args.listen
    with user_input():
        config = LinkConfig(
            target_host, target_port, listen[0], listen[1], parse_rate(args.rate), parse_rate(args.flow_rate),
            parse_bytes(args.window), args.delay_ms, args.jitter_ms, RateSchedule.parse(args.schedule),
            args.read_bytes, args.seed, args.splice == "on",
        )  # fmt: skip
    return asyncio.run(_serve(config, args.control))


async def _serve(config: LinkConfig, control: tuple[str, int]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with LinkEmulator(config) as link:
        server = await asyncio.start_server(lambda r, w: _control_session(link, r, w), *control)
        async with server:
            control_port = server.sockets[0].getsockname()[1]
            print(json.dumps({"port": link.port, "control_port": control_port}), flush=True)
            await stop.wait()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m minifaas.transport.emulator", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
