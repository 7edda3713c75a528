"""Challenge-response handshake: both ends prove they hold the cluster's shared secret, and agree on codecs.

Runs once per connection, before any frame is read. It authenticates; it does not encrypt (use TLS for that).

    receiver -> sender   b"MFK2" + 32-byte receiver nonce + u8 codec offer + 3 zero bytes
    sender -> receiver   32-byte sender nonce + HMAC-SHA256(secret, "send" | receiver hello | sender nonce)
    receiver -> sender   HMAC-SHA256(secret, "recv" | sender nonce | receiver hello)

The offer has bit i set for each ``codec.Codec`` i the receiver decodes. Control sessions use the magic b"MFC1"
and no offer, and sign messages with the key HMAC-SHA256(secret, "key" | hello | client nonce).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from minifaas.net.channel import Channel
from minifaas.net.errors import AuthError, ProtocolError, TransferError

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
    except TransferError as e:
        raise AuthError(f"handshake failed: {e}") from None
    theirs, their_mac = bytes(answer[:NONCE_BYTES]), bytes(answer[NONCE_BYTES:])
    if not hmac.compare_digest(their_mac, mac(secret, b"send", hello, theirs)):
        raise AuthError("the sender does not hold the shared secret")
    await channel.send([mac(secret, b"recv", theirs, hello)], timeout)
    return session_key(secret, hello, theirs)
