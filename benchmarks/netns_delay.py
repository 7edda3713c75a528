"""The round trip of a namespace link, made in user space: every packet of the return path held for the RTT.

netem is the usual way to delay packets, but not every kernel has it (on
some, ``tc qdisc add ... netem`` answers "Specified qdisc kind is unknown"),
and tbf only queues, so a sender could fill its queue but never wait for a
far end. Instead the receiving namespace routes what it sends back (its ACKs
and replies) into a tun device; this process reads each packet from it, holds
it for the round trip and writes it, framed for the sender's veth, onto the
receiver's veth with an AF_PACKET socket. The data path is untouched, so the
kernel's tbf is still the bottleneck it meets. A TCP sender's window, ACK
clock and retransmission timer depend on the round trip alone, so the whole
RTT on the return path is, to it, a link with that RTT: its reading of the
RTT (TCP_INFO) says so.

    python benchmarks/netns_delay.py --tun mfrtt --out mfvb1x0 --to 02:00:00:00:00:01 --delay-ms 30

run inside the receiving namespace (``NetnsLink`` starts it and routes the
return path into its tun). It prints one JSON line once the tun exists, then
holds and forwards until it is killed. Packets leave in the order they came
(one delay for all: nothing is reordered), up to about a millisecond late
(the poll's resolution). IPv4 only; anything else read from the tun is dropped.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import select
import socket
import struct
import sys
import time
from collections import deque

from minifaas.commands.arguments import non_negative

_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_ETH_P_IP = b"\x08\x00"


def open_tun(name: str) -> int:
    """A tun device ``name`` in this namespace, as a non-blocking fd; it lives as long as the fd."""
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SystemExit(f"netns_delay: cannot open /dev/net/tun: {e}") from None
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


def forward(tun: int, out: socket.socket, frame_header: bytes, delay_s: float) -> None:
    """Hold each packet read from ``tun`` for ``delay_s``, then send it on ``out`` behind ``frame_header``."""
    held: deque[tuple[float, bytes]] = deque()
    poller = select.poll()
    poller.register(tun, select.POLLIN)
    while True:
        wait_ms = None if not held else max(0, math.ceil((held[0][0] - time.monotonic()) * 1000))
        ready = poller.poll(wait_ms)
        now = time.monotonic()
        if ready:
            while True:
                try:
                    packet = os.read(tun, 65536)
                except BlockingIOError:
                    break
                if packet and packet[0] >> 4 == 4:
                    held.append((now + delay_s, frame_header + packet))
        while held and held[0][0] <= now:
            out.send(held.popleft()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/netns_delay.py", description=__doc__.splitlines()[0])
    parser.add_argument("--tun", required=True, help="name of the tun device to make and read")
    parser.add_argument("--out", required=True, help="the veth to send the held packets on")
    parser.add_argument("--to", required=True, help="MAC address of the veth at the other end")
    parser.add_argument("--delay-ms", type=non_negative, required=True, help="how long each packet is held (the RTT)")
    args = parser.parse_args(argv)
    if not 0 < args.delay_ms <= 10_000:
        parser.error("--delay-ms must be in (0, 10000]")
    try:
        peer = bytes.fromhex(args.to.replace(":", ""))
    except ValueError:
        parser.error(f"--to: not a MAC address: {args.to!r}")
    if len(peer) != 6:
        parser.error(f"--to: not a MAC address: {args.to!r}")
    tun = open_tun(args.tun)
    out = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    out.bind((args.out, 0))
    own = out.getsockname()[4]
    print(json.dumps({"tun": args.tun, "out": args.out, "delay_ms": args.delay_ms}), flush=True)
    forward(tun, out, peer + own + _ETH_P_IP, args.delay_ms / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
