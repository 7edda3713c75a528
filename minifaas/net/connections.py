"""Authenticated connections: the handshake each one starts with, and a sender's pool of them to one receiver.

The handshake runs once per connection, before any frame is read: both ends prove they hold the cluster's shared
secret, and agree on codecs. It authenticates; it does not encrypt (use TLS for that).

    receiver -> sender   b"MFK2" + 32-byte receiver nonce + u8 codec offer + 3 zero bytes
    sender -> receiver   32-byte sender nonce + HMAC-SHA256(secret, "send" | receiver hello | sender nonce)
    receiver -> sender   HMAC-SHA256(secret, "recv" | sender nonce | receiver hello)

The offer has bit i set for each ``codec.Codec`` i the receiver decodes. Control sessions use the magic b"MFC1"
and no offer, and sign messages with the key HMAC-SHA256(secret, "key" | hello | client nonce). A transfer
borrows pooled connections and gives back only those it ended cleanly on; an idle one is checked before it is
lent again.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import socket
import ssl as ssl_module
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

from minifaas.net.channel import Buffer, Channel, open_channel
from minifaas.net.errors import AuthError, ConnectionLostError, ProtocolError, TransferError, TruncatedError

log = logging.getLogger(__name__)

MAGIC = b"MFK2"
OLD_MAGIC = b"MFKA"  # wire version 1
CONTROL = b"MFC1"  # a control session's handshake
NONCE_BYTES = 32
MAC_BYTES = 32
MIN_SECRET_BYTES = 16
_OFFER = struct.Struct("<B3x")
HELLO_BYTES = len(MAGIC) + NONCE_BYTES + _OFFER.size


def mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def check_secret(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the shared secret needs at least {MIN_SECRET_BYTES} bytes")


def session_key(secret: bytes, hello: bytes, client_nonce: bytes) -> bytes:
    return mac(secret, b"key", hello, client_nonce)


async def prove_as_sender(channel: Channel, secret: bytes, timeout: float) -> int:
    """Client side of the handshake; returns the receiver's codec offer. Raises AuthError if either side
    fails to prove itself, ProtocolError if the receiver speaks another wire version."""
    return (await _prove(channel, secret, timeout, MAGIC))[0]


async def prove_control_client(channel: Channel, secret: bytes, timeout: float) -> bytes:
    """Client side of a control session's handshake; returns the session key. Raises AuthError."""
    return (await _prove(channel, secret, timeout, CONTROL))[1]


async def _prove(channel: Channel, secret: bytes, timeout: float, magic: bytes) -> tuple[int, bytes]:
    try:
        head = await channel.recv_exactly(len(MAGIC) + NONCE_BYTES, timeout)  # as long as a version-1 hello
    except (ConnectionLostError, TruncatedError):
        raise  # the peer went before its hello, which it sends whatever our secret: no word on the secret
    except TransferError as e:
        raise AuthError(f"handshake failed: {e}") from None
    try:
        if head[: len(MAGIC)] == OLD_MAGIC and magic == MAGIC:
            raise ProtocolError("the receiver speaks KV wire version 1, which this sender no longer speaks")
        if head[: len(MAGIC)] != magic:
            what = "a KV receiver" if magic == MAGIC else "a control port"
            raise AuthError(f"the peer is not {what} (handshake magic {bytes(head[: len(MAGIC)])!r})")
        hello = bytes(head + await channel.recv_exactly(_OFFER.size, timeout))
        ours = secrets.token_bytes(NONCE_BYTES)
        await channel.send([ours, mac(secret, b"send", hello, ours)], timeout)
        reply = await channel.recv_exactly(MAC_BYTES, timeout)
    except (AuthError, ProtocolError):
        raise
    except TransferError as e:
        raise AuthError(f"handshake failed (wrong secret?): {e}") from None
    if not hmac.compare_digest(bytes(reply), mac(secret, b"recv", ours, hello)):
        raise AuthError("the receiver does not hold the shared secret")
    return _OFFER.unpack_from(hello, len(MAGIC) + NONCE_BYTES)[0], session_key(secret, hello, ours)


async def verify_sender(channel: Channel, secret: bytes, timeout: float, offer: int) -> None:
    """Server side of the handshake, offering the codecs in ``offer``; raises AuthError."""
    await _verify(channel, secret, timeout, MAGIC, offer)


async def verify_control_client(channel: Channel, secret: bytes, timeout: float) -> bytes:
    """Server side of a control session's handshake; returns the session key. Raises AuthError."""
    return await _verify(channel, secret, timeout, CONTROL, 0)


async def _verify(channel: Channel, secret: bytes, timeout: float, magic: bytes, offer: int) -> bytes:
    hello = magic + secrets.token_bytes(NONCE_BYTES) + _OFFER.pack(offer)
    try:
        await channel.send([hello], timeout)
        answer = await channel.recv_exactly(NONCE_BYTES + MAC_BYTES, timeout)
    except (ConnectionLostError, TruncatedError):
        raise  # the peer left before it answered (a sender that gave up): no evidence against it
    except TransferError as e:
        raise AuthError(f"handshake failed: {e}") from None
    theirs, their_mac = bytes(answer[:NONCE_BYTES]), bytes(answer[NONCE_BYTES:])
    if not hmac.compare_digest(their_mac, mac(secret, b"send", hello, theirs)):
        raise AuthError("the sender does not hold the shared secret")
    await channel.send([mac(secret, b"recv", theirs, hello)], timeout)
    return session_key(secret, hello, theirs)


# Offsets into Linux's struct tcp_info (include/uapi/linux/tcp.h); all fields since Linux 4.19.
_FIELDS = {
    "rtt_us": (68, "I"),
    "rttvar_us": (72, "I"),
    "total_retrans": (100, "I"),
    "bytes_acked": (120, "Q"),
    "notsent_bytes": (144, "I"),
    "delivery_rate": (160, "Q"),  # bytes per second
    "bytes_sent": (200, "Q"),
    "bytes_retrans": (208, "Q"),
}
TCP_INFO_BYTES = 232


@dataclass(frozen=True, slots=True)
class TcpInfo:
    rtt_us: int
    rttvar_us: int
    total_retrans: int
    bytes_acked: int
    notsent_bytes: int
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


class Connections:
    """A sender's authenticated connections to one receiver: idle ones kept for the next transfers, every live one
    listed (by connection id) so link health can sample it."""

    def __init__(
        self, host: str, port: int, secret: bytes, max_idle: int, connect_timeout: float = 5.0,
        unsent_limit: int | None = None, ssl: ssl_module.SSLContext | None = None,
    ):  # fmt: skip
        self.host, self.port, self._secret, self.max_idle = host, port, secret, max_idle
        self._connect_timeout, self._unsent_limit, self._ssl = connect_timeout, unsent_limit, ssl
        self._idle: list[Channel] = []
        self.live: dict[int, Channel] = {}
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

    async def send(self, channel: Channel, parts: Sequence[Buffer], timeout: float | None) -> Channel:
        """Send on a lent connection; the one that carried it: a new one if this was a reused connection's first
        send and it failed (nothing of the transfer reached a receiver through it)."""
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
        log.info("pooled connection to %s:%d dropped (%s); dialling a new one", self.host, self.port, why)
        self.discard(channel, reset=True)

    async def _dial(self) -> Channel:
        timeout = self._connect_timeout
        channel = await open_channel(self.host, self.port, timeout, self._ssl, self._unsent_limit)
        try:
            self._offers[channel] = await prove_as_sender(channel, self._secret, timeout)
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
