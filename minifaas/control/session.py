"""One authenticated control session over TCP or TLS: the KV link's handshake, then signed JSON messages.

    frame   length u32 big-endian | MAC 32 B | body: one JSON object, UTF-8 (length counts the body)
    MAC     HMAC-SHA256(session key, direction byte | sequence number u64 | body)

Each direction numbers its frames, so an injected, replayed or reordered frame fails its MAC. An ``Oversized``
or ``Forged`` frame ends the session; a ``Garbled`` body (signed, but not a JSON object) does not.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ssl as ssl_module
import struct
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from minifaas.net.channel import Channel
from minifaas.net.connections import MAC_BYTES, prove_control_client, verify_control_client
from minifaas.net.errors import AuthError, TransferError

MAX_BYTES = 64 << 20  # a prompt of a few million token ids still fits
Why = Annotated[str, Meta(max_length=MAX_BYTES)]  # an exception's text: as long as a frame allows
_PREFIX = struct.Struct(">I")
_FROM_CLIENT, _FROM_SERVER = b"c", b"s"


class Message(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True, tag_field="op"):
    """A control message; a field that defaults to None may be left out, and is left out when None."""

    @property
    def op(self) -> str:
        return self.__struct_config__.tag  # type: ignore[return-value]


class ControlError(Exception):
    """A control session failed or refused something."""


class SessionLost(ControlError):
    """The connection closed, broke, or went silent past its deadline."""


class PeerSilent(SessionLost):
    """The peer stopped answering within its deadline: hung, stopped or cut off, not known to have crashed."""


class Refused(ControlError):
    """The handshake failed, or the server refused this client (it serves another)."""


class Forged(ControlError):
    """A frame's MAC did not verify: not from the peer, or altered on the way."""


class Oversized(ControlError):
    """A frame longer than the session accepts."""


class Garbled(ControlError):
    """A signed frame whose body is not a JSON object."""


def _wire(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Channel:
    """The streams as the handshake's connection: exact reads and sends, each with a deadline."""
    return Channel(writer.get_extra_info("socket"), (reader, writer))


class Session:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes, server: bool, max_bytes: int
    ) -> None:
        self._reader, self._writer, self._key, self.max_bytes = reader, writer, key, max_bytes
        self._out, self._in = (_FROM_SERVER, _FROM_CLIENT) if server else (_FROM_CLIENT, _FROM_SERVER)
        self._sent = self._received = 0
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.closed = False

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self._key, direction + seq.to_bytes(8, "big") + body, hashlib.sha256).digest()

    def send(self, message: object) -> None:
        """Queue one message, a dict or a msgspec Struct (call ``drain`` now and then); raises SessionLost once the
        session is over."""
        if self.closed or self._writer.is_closing():
            raise SessionLost(f"the session with {self.peer} is closed")
        body = msgspec.json.encode(message)
        self._writer.write(_PREFIX.pack(len(body)) + self._mac(self._out, self._sent, body) + body)
        self._sent += 1

    async def drain(self, timeout: float | None = None) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self._writer.drain()
        except TimeoutError:
            raise PeerSilent(f"{self.peer} took nothing for {timeout} s") from None
        except OSError as e:
            raise SessionLost(f"{self.peer}: {e}") from None

    async def recv(self, timeout: float | None = None) -> dict | None:
        """The next message, or None when the peer closed cleanly between frames."""
        try:
            async with asyncio.timeout(timeout):
                head = await self._reader.readexactly(_PREFIX.size + MAC_BYTES)
                (length,) = _PREFIX.unpack_from(head)
                if length > self.max_bytes:
                    raise Oversized(f"a frame of {length} bytes from {self.peer} (at most {self.max_bytes})")
                body = await self._reader.readexactly(length)
        except TimeoutError:
            raise PeerSilent(f"nothing heard from {self.peer} for {timeout} s") from None
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                return None
            raise SessionLost(f"{self.peer} closed the session in the middle of a frame") from None
        except OSError as e:
            raise SessionLost(f"{self.peer}: {e}") from None
        if not hmac.compare_digest(head[_PREFIX.size :], self._mac(self._in, self._received, body)):
            raise Forged(f"frame {self._received} from {self.peer} does not carry the session's MAC")
        self._received += 1
        try:
            message = msgspec.json.decode(body)
        except msgspec.DecodeError as e:  # malformed, not UTF-8, or a NaN or infinite number
            raise Garbled(f"not JSON: {e}") from None
        if not isinstance(message, dict):
            raise Garbled(f"a JSON {type(message).__name__}, not an object")
        return message

    def close(self) -> None:
        self.closed = True
        self._writer.close()


async def connect(
    host: str,
    port: int,
    secret: bytes,
    timeout: float,
    ssl: ssl_module.SSLContext | None = None,
    max_bytes: int = MAX_BYTES,
) -> Session:
    """Dial a control port and prove the secret both ways; raises SessionLost or Refused."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port, ssl=ssl)
    except TimeoutError:
        raise SessionLost(f"connecting to {host}:{port} took over {timeout} s") from None
    except OSError as e:
        raise SessionLost(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
    try:
        key = await prove_control_client(_wire(reader, writer), secret, timeout)
    except AuthError as e:
        writer.close()
        raise Refused(f"{host}:{port}: {e}") from None
    except TransferError as e:  # the server went before its hello (stopping, say): try again later
        writer.close()
        raise SessionLost(f"{host}:{port} closed the connection before its handshake: {e}") from None
    return Session(reader, writer, key, server=False, max_bytes=max_bytes)


async def accept(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes, timeout: float, max_bytes: int
) -> Session:
    """The server's side of a new connection: the client proves the secret, or Refused."""
    try:
        key = await verify_control_client(_wire(reader, writer), secret, timeout)
    except AuthError as e:
        raise Refused(str(e)) from None
    except TransferError as e:  # the client left before it answered
        raise Refused(f"handshake failed: {e}") from None
    return Session(reader, writer, key, server=True, max_bytes=max_bytes)
