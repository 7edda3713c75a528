"""``minifaas link-emulator``: the link emulator's flags, read into a ``RelayConfig`` and served.

The process itself (relay, control port, commands) is ``emulator/emulator_server.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from minifaas.commands import arguments
from minifaas.commands.main import main as cli_main
from minifaas.commands.main import user_input
from minifaas.control.secret import load_secret
from minifaas.emulator.emulator_server import serve_link
from minifaas.emulator.pacer import RateSchedule, parse_bytes, parse_rate
from minifaas.emulator.relay import RelayConfig
from minifaas.parent_watch import die_with_parent
from minifaas.proctitle import set_title


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
    parser.add_argument(
        "--delay-ms", type=arguments.non_negative, default=0.0, help="one-way delay (the RTT is twice it)"
    )
    parser.add_argument("--jitter-ms", type=arguments.non_negative, default=0.0, help="uniform +- jitter on the delay")
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
        "--control-idle", type=arguments.positive, default=30.0, help="drop a control client silent this long, seconds"
    )
    parser.add_argument(
        "--exit-with-stdin", action="store_true", help="exit when stdin closes; ^C is the parent's (the gateway's)"
    )


def run(args: argparse.Namespace) -> int:
    (target_host, target_port), listen = args.target, args.listen
    with user_input():
        secret = load_secret(args.secret_file)
        config = RelayConfig(
            target_host, target_port, listen[0], listen[1], parse_rate(args.rate), parse_rate(args.flow_rate),
            parse_bytes(args.window), args.delay_ms, args.jitter_ms, RateSchedule.parse(args.schedule),
            args.read_bytes, args.seed, args.splice == "on",
        )  # fmt: skip
    die_with_parent()
    port = f":{listen[1]}" if listen[1] else ""  # port 0: the one it binds is known only inside ``serve``
    set_title("link-emulator", port, f"-> {target_host}:{target_port}")
    route_hosts = frozenset(args.route_host or [target_host])
    return asyncio.run(serve_link(config, secret, args.control, route_hosts, args.control_idle, args.exit_with_stdin))


if __name__ == "__main__":  # as the gateway starts it: errors as ``minifaas link-emulator`` gives them, one line
    sys.exit(cli_main(["link-emulator", *sys.argv[1:]]))
