"""Authenticated connections to one receiver, dialled once and reused between transfers.

A transfer borrows connections and gives back only those it ended cleanly on. An idle connection is checked
before it is lent again; every live one is listed so link health can sample its TCP_INFO.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as ssl_module
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

from minifaas.net.auth import prove_as_sender
from minifaas.net.channel import Buffer, Channel, open_channel
from minifaas.net.errors import ConnectionLostError

log = logging.getLogger(__name__)

# Offsets into Linux's struct tcp_info (include/uapi/linux/tcp.h); all fields since Linux 4.19.
_FIELDS = {
    "retransmits": (2, "B"),
    "rto_us": (8, "I"),
    "unacked": (24, "I"),
    "lost": (32, "I"),
    "rtt_us": (68, "I"),
    "rttvar_us": (72, "I"),
    "cwnd": (80, "I"),
    "total_retrans": (100, "I"),
    "bytes_acked": (120, "Q"),
    "notsent_bytes": (144, "I"),
    "min_rtt_us": (148, "I"),
    "delivery_rate": (160, "Q"),  # bytes per second
    "bytes_sent": (200, "Q"),
    "bytes_retrans": (208, "Q"),
}
TCP_INFO_BYTES = 232


@dataclass(frozen=True, slots=True)
class TcpInfo:
    retransmits: int  # retransmissions of the segment at the head of the queue right now
    rto_us: int
    unacked: int
    lost: int
    rtt_us: int
    rttvar_us: int
    cwnd: int  # segments
    total_retrans: int
    bytes_acked: int
    notsent_bytes: int
    min_rtt_us: int
    delivery_rate: int  # bytes/s, the kernel's estimate
    bytes_sent: int  # including retransmissions
    bytes_retrans: int

    @classmethod
    def parse(cls, raw: bytes) -> TcpInfo:
        if len(raw) < TCP_INFO_BYTES:
            raise ValueError(f"tcp_info of {len(raw)} bytes: this kernel is older than the fields we read")
        return cls(**{name: struct.unpack_from("<" + fmt, raw, off)[0] for name, (off, fmt) in _FIELDS.items()})


def read_tcp_info(sock: socket.socket) -> TcpInfo:
    return TcpInfo.parse(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES))


# Enough connections to fill a cross-datacenter link through untuned hosts' TCP windows
# (docs/ARCHITECTURE.md, "Connections, windows and the round trip").
DEFAULT_CONNECTIONS = 16
MAX_CONNECTIONS = 64


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    secret: bytes
    connect_timeout: float = 5.0
    unsent_limit: int | None = None


class Connections:
    def __init__(self, endpoint: Endpoint, max_idle: int, ssl: ssl_module.SSLContext | None = None):
        self.endpoint = endpoint
        self.max_idle = max_idle
        self._ssl = ssl
        self._idle: list[Channel] = []
        self.live: dict[int, Channel] = {}  # connection id -> channel
        self._offers: dict[Channel, int] = {}  # the codec offer each connection's handshake made
        self._ids = count()
        self._reused: set[Channel] = set()  # lent from the idle list, their first send not made yet
        self.dialled = 0
        self.stale = 0  # idle connections found dead and dropped, or replaced after a failed first send

    async def acquire(self, n: int) -> list[Channel]:
        """``n`` connections: idle ones that are still usable first, the rest dialled in parallel."""
        taken: list[Channel] = []
        while self._idle and len(taken) < n:
            channel = self._idle.pop()
            if channel.usable():
                taken.append(channel)
                self._reused.add(channel)
            else:
                self._replaced(channel, "the receiver closed it while it was idle")
        dials: list[asyncio.Task[Channel]] = []
        try:
            async with asyncio.TaskGroup() as tg:
                dials.extend(tg.create_task(self._dial()) for _ in range(n - len(taken)))
        except BaseExceptionGroup as eg:
            dialled = [t.result() for t in dials if t.done() and not t.cancelled() and t.exception() is None]
            for channel in taken + dialled:
                self.release(channel)
            raise eg.exceptions[0] from None
        return taken + [task.result() for task in dials]

    async def send_first(self, channel: Channel, parts: Sequence[Buffer], timeout: float | None) -> Channel:
        """A transfer's first send on ``channel``; the connection that carried it (a new one if a reused
        connection failed: nothing of the transfer reached a receiver through it)."""
        reused = channel in self._reused
        self._reused.discard(channel)
        try:
            await channel.send(parts, timeout)
            return channel
        except ConnectionLostError as e:
            if not reused:
                raise
            self._replaced(channel, str(e))
        fresh = await self._dial()
        await fresh.send(parts, timeout)
        return fresh

    def _replaced(self, channel: Channel, why: str) -> None:
        self.stale += 1
        e = self.endpoint
        log.info("pooled connection to %s:%d dropped (%s); dialling a new one", e.host, e.port, why)
        self.discard(channel, reset=True)

    async def _dial(self) -> Channel:
        e = self.endpoint
        channel = await open_channel(e.host, e.port, e.connect_timeout, self._ssl, e.unsent_limit)
        try:
            self._offers[channel] = await prove_as_sender(channel, e.secret, e.connect_timeout)
        except BaseException:
            channel.close(reset=True)
            raise
        self.dialled += 1
        self.live[next(self._ids)] = channel
        return channel

    def offer(self, channels: list[Channel]) -> int:
        """The codec offer all of ``channels`` share (their receivers' handshakes, ANDed)."""
        mask = 0xFF
        for channel in channels:
            mask &= self._offers.get(channel, 0)
        return mask

    def release(self, channel: Channel) -> None:
        self._reused.discard(channel)
        if channel.closed or len(self._idle) >= self.max_idle:
            self.discard(channel)
        else:
            self._idle.append(channel)

    def discard(self, channel: Channel, reset: bool = False) -> None:
        self._reused.discard(channel)
        channel.close(reset=reset)
        self._offers.pop(channel, None)
        for key, ch in list(self.live.items()):
            if ch is channel:
                del self.live[key]

    def close(self) -> None:
        for channel in list(self.live.values()):
            self.discard(channel)
        self._idle.clear()
