"""Challenge-response handshake: both ends prove they hold the cluster's shared secret.

Runs once per connection, before any frame is read, so an unauthenticated peer
never makes the receiver parse a header or set aside memory.

    receiver -> sender   b"MFKA" + 32-byte receiver nonce
    sender -> receiver   32-byte sender nonce + HMAC-SHA256(secret, "send" | receiver nonce | sender nonce)
    receiver -> sender   HMAC-SHA256(secret, "recv" | sender nonce | receiver nonce)

The receiver closes the connection on a wrong MAC; the sender checks the
receiver's MAC too, so KV is never handed to a peer that lacks the secret.
The MACs are bound to fresh nonces from both ends, so a recorded handshake
cannot be replayed. This authenticates; it does not encrypt: use TLS for that.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from minifaas.transport.channel import Channel
from minifaas.transport.errors import AuthError, TransferError

MAGIC = b"MFKA"
NONCE_BYTES = 32
MAC_BYTES = 32
MIN_SECRET_BYTES = 16


def mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def check_secret(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the shared secret needs at least {MIN_SECRET_BYTES} bytes")


async def prove_as_sender(channel: Channel, secret: bytes, timeout: float) -> None:
    """Client side of the handshake; raises AuthError if either side fails to prove itself."""
    try:
        hello = await channel.recv_exactly(len(MAGIC) + NONCE_BYTES, timeout)
        if hello[: len(MAGIC)] != MAGIC:
            raise AuthError("the peer is not a KV receiver (bad handshake magic)")
        theirs = bytes(hello[len(MAGIC) :])
        ours = secrets.token_bytes(NONCE_BYTES)
        await channel.send([ours, mac(secret, b"send", theirs, ours)], timeout)
        reply = await channel.recv_exactly(MAC_BYTES, timeout)
    except AuthError:
        raise
    except TransferError as e:
        raise AuthError(f"handshake failed (wrong secret?): {e}") from None
    if not hmac.compare_digest(bytes(reply), mac(secret, b"recv", ours, theirs)):
        raise AuthError("the receiver does not hold the shared secret")


async def verify_sender(channel: Channel, secret: bytes, timeout: float) -> None:
    """Server side of the handshake; raises AuthError (the caller then drops the connection)."""
    ours = secrets.token_bytes(NONCE_BYTES)
    try:
        await channel.send([MAGIC, ours], timeout)
        answer = await channel.recv_exactly(NONCE_BYTES + MAC_BYTES, timeout)
    except TransferError as e:
        raise AuthError(f"handshake failed: {e}") from None
    theirs, their_mac = bytes(answer[:NONCE_BYTES]), bytes(answer[NONCE_BYTES:])
    if not hmac.compare_digest(their_mac, mac(secret, b"send", ours, theirs)):
        raise AuthError("the sender does not hold the shared secret")
    await channel.send([mac(secret, b"recv", theirs, ours)], timeout)
