"""The control channel mechanism over real sockets: handshake, signed frames, one client, deadlines, schemas."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
from pathlib import Path
from typing import Annotated

import pytest
from msgspec import Meta, Struct
from test_transport import tls_contexts

from minifaas.control.heartbeat import Heartbeat, HeartbeatConfig, keep_alive
from minifaas.control.secret import SECRET_ENV, load_secret
from minifaas.control.server import ControlServer
from minifaas.control.session import (
    _PREFIX,
    Garbled,
    Message,
    PeerSilent,
    Refused,
    Session,
    SessionLost,
    _wire,
    connect,
)
from minifaas.control.worker_ops import BadMessage, from_wire
from minifaas.net.address import Address
from minifaas.net.connections import CONTROL, prove_as_sender, prove_control_client

SECRET = b"control-test-secret-0123456789"


class Echo(Message, tag="echo"):
    n: Annotated[int, Meta(ge=0, le=100)]


class Hang(Message, tag="hang"):
    pass


class Bye(Message, tag="bye"):
    pass


SCHEMAS = {"echo": Echo, "hang": Hang, "bye": Bye}


def validate(message: dict, schemas: dict[str, type[Message]]) -> tuple[str, dict]:
    """The message's op and the message, if its op's class allows it."""
    from_wire(message, schemas)
    return message["op"], message


async def _echo(server: ControlServer, session: Session) -> None:
    """Echo each valid message; answer a bad one and go on; ``hang`` stops answering; ``bye`` hangs up."""
    while (msg := await _recv_or_error(session, server.deadline_s)) is not None:
        if msg.get("op") == "hang":
            await asyncio.sleep(3600)
        if msg.get("op") == "bye":
            return
        session.send(msg)
        await session.drain(5)


async def _recv_or_error(session: Session, timeout: float) -> dict | None:
    while True:
        try:
            raw = await session.recv(timeout)
            return raw if raw is None else validate(raw, SCHEMAS)[1]
        except (Garbled, BadMessage) as e:
            session.send({"op": "error", "error": str(e)})


def _server(**options: object) -> ControlServer:
    holder: list[ControlServer] = []
    server = ControlServer(("127.0.0.1", 0), SECRET, lambda s: _echo(holder[0], s), **options)  # type: ignore[arg-type]
    holder.append(server)
    return server


async def _round_trip(port: int, n: int = 1, **options: object) -> dict | None:
    session = await connect("127.0.0.1", port, SECRET, 5.0, **options)  # type: ignore[arg-type]
    try:
        session.send({"op": "echo", "n": n})
        return await session.recv(5)
    finally:
        session.close()


def test_one_client_is_served_and_a_second_is_refused() -> None:
    async def main() -> None:
        async with _server() as server:
            first = await connect("127.0.0.1", server.port, SECRET, 5.0)
            first.send({"op": "echo", "n": 1})
            assert await first.recv(5) == {"op": "echo", "n": 1}
            second = await connect("127.0.0.1", server.port, SECRET, 5.0)  # proves the secret, then is refused
            reply = await second.recv(5)
            assert reply is not None and reply["op"] == "refused" and await second.recv(5) is None
            first.send({"op": "echo", "n": 2})  # the first is not disturbed
            assert await first.recv(5) == {"op": "echo", "n": 2}
            first.close()
            async with asyncio.timeout(5):
                while server.active is not None:
                    await asyncio.sleep(0.01)
            assert await _round_trip(server.port, 3) == {"op": "echo", "n": 3}  # the next one attaches
            assert server.sessions == 2 and server.refused == 1

    asyncio.run(main())


def test_a_port_that_hangs_up_before_its_hello_is_a_lost_session_not_a_refusal() -> None:
    """What a worker's control port does while it stops: the gateway tries again rather than give up on it."""

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    async def main() -> None:
        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            with pytest.raises(SessionLost, match="closed the connection before its handshake"):
                await connect("127.0.0.1", port, SECRET, 5.0)

    asyncio.run(main())


def test_no_secret_wrong_secret_and_the_kv_handshake_are_refused() -> None:
    async def main() -> None:
        async with _server() as server:
            with pytest.raises(Refused):
                await connect("127.0.0.1", server.port, b"not-the-secret-0123456789", 5.0)
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b'{"op": "echo", "n": 1}\n' * 4)  # JSON lines, no handshake
            assert (await reader.read(100))[:4] == CONTROL  # the server's challenge, then it hangs up
            assert await reader.read(100) == b""
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)  # the KV link's handshake
            with pytest.raises(Exception, match="not a KV receiver"):
                await prove_as_sender(_wire(reader, writer), SECRET, 5.0)
            writer.close()
            async with asyncio.timeout(5):
                while server.refused < 3:
                    await asyncio.sleep(0.01)
            assert server.sessions == 0
            assert await _round_trip(server.port) == {"op": "echo", "n": 1}

    asyncio.run(main())


async def _authenticated_raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = await prove_control_client(_wire(reader, writer), SECRET, 5.0)
    return reader, writer, key


def test_garbled_forged_and_oversized_frames_leave_the_server_serving() -> None:
    async def main() -> None:
        async with _server(max_bytes=1024) as server:
            session = await connect("127.0.0.1", server.port, SECRET, 5.0)
            for bad in ({"op": "nope"}, {"op": "echo"}, {"op": "echo", "n": "x"}, {"op": "echo", "n": 1, "x": 2}):
                session.send(bad)
                reply = await session.recv(5)
                assert reply is not None and reply["op"] == "error", bad
            for body in (b'{"op":"echo","n":NaN}', b'{"op":"echo","n":1e999}', b'{"op":"echo","n":"\xff"}', b"[1]"):
                session._writer.write(_PREFIX.pack(len(body)) + session._mac(b"c", session._sent, body) + body)
                session._sent += 1  # signed, but not a JSON object of finite numbers
                reply = await session.recv(5)
                assert reply is not None and reply["op"] == "error", body
            session.send({"op": "echo", "n": 7})  # the session goes on after signed but bad messages
            assert await session.recv(5) == {"op": "echo", "n": 7}
            session.close()

            for forge in ("wrong key", "replay", "oversized", "truncated"):
                reader, writer, key = await _authenticated_raw(server.port)
                forged = Session(reader, writer, b"x" * 32 if forge == "wrong key" else key, False, 1 << 20)
                if forge == "replay":  # a frame signed for position 0 sent again at position 1
                    frame = {"op": "echo", "n": 1}
                    forged.send(frame)
                    forged._sent = 0
                    forged.send(frame)
                    assert await forged.recv(5) == frame
                elif forge == "oversized":
                    writer.write(struct.pack(">I", 1 << 30) + b"\0" * 32)
                elif forge == "truncated":
                    writer.write(struct.pack(">I", 100) + b"\0" * 40)
                    writer.write_eof()
                else:
                    forged.send({"op": "echo", "n": 1})
                assert await reader.read() == b"", forge  # the server hung up on the forged session
                writer.close()
                assert await _round_trip(server.port) == {"op": "echo", "n": 1}, forge

    asyncio.run(main())


def test_a_silent_client_is_dropped_and_handshakes_are_bounded() -> None:
    async def main() -> None:
        async with _server(deadline_s=0.5, handshake_timeout=0.5, max_pending=2) as server:
            session = await connect("127.0.0.1", server.port, SECRET, 5.0)
            assert await session.recv(5) is None  # it said nothing for 0.5 s: the server ended the session
            idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
            assert await idle[2][0].read() == b""  # over max_pending: closed at once
            for reader, writer in idle[:2]:
                async with asyncio.timeout(5):  # the stalled handshakes end by themselves
                    await reader.read()
                writer.close()
            assert await _round_trip(server.port) == {"op": "echo", "n": 1}

    asyncio.run(main())


@pytest.mark.parametrize("last", ["hang", "bye"])
def test_keep_alive_tells_a_peer_that_stops_answering_from_one_that_hangs_up(last: str) -> None:
    async def main() -> None:
        async with _server() as server:
            session = await connect("127.0.0.1", server.port, SECRET, 5.0)
            seen: list[dict] = []
            pings = iter(range(1000))

            def ping() -> dict:
                n = next(pings)
                return {"op": last} if n == 3 else {"op": "echo", "n": n}

            loop = asyncio.get_running_loop()
            began = loop.time()
            lost = await keep_alive(session, HeartbeatConfig(0.05, 0.4), seen.append, ping)
            assert [m["n"] for m in seen] == [0, 1, 2]
            if last == "hang":  # silent: hung or stopped, not known to be gone
                assert isinstance(lost, PeerSilent) and "did not answer a ping" in str(lost)
                assert 0.4 < loop.time() - began < 3
            else:
                assert isinstance(lost, SessionLost) and not isinstance(lost, PeerSilent), lost

    asyncio.run(main())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate")
def test_a_session_over_tls(tmp_path: Path) -> None:
    server_ctx, client_ctx = tls_contexts(tmp_path)

    async def main() -> None:
        async with _server(ssl=server_ctx) as server:
            assert await _round_trip(server.port, 5, ssl=client_ctx) == {"op": "echo", "n": 5}
            with pytest.raises(Refused):  # a plain client gets no challenge from a TLS port
                await connect("127.0.0.1", server.port, SECRET, 1.0)

    asyncio.run(main())


def test_heartbeat_rule() -> None:
    beat = Heartbeat(HeartbeatConfig(1.0, 5.0), now=100.0)
    assert beat.ping_due(100.0) and not beat.late(200.0)  # nothing asked, nothing owed
    beat.pinged(100.0)
    assert not beat.ping_due(100.5) and beat.ping_due(101.0)
    beat.pinged(101.0)  # still unanswered: the deadline runs from the first ping
    assert not beat.late(105.0) and beat.late(105.5) and beat.deadline_left(104.0) == 1.0
    beat.heard(104.0)
    assert not beat.late(300.0) and beat.deadline_left(300.0) == 5.0
    beat.pinged(300.0)  # this side stalled for minutes: the peer is judged from the ping after it
    assert not beat.late(304.0) and beat.late(305.5)
    with pytest.raises(ValueError):
        HeartbeatConfig(5.0, 5.0)


class Sub(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(max_length=3)]


class Go(Message, tag="go"):
    tokens: Annotated[list[Annotated[int, Meta(ge=0, le=255)]], Meta(max_length=4)]
    kv: Address
    sub: Sub
    rate: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None


def test_schema() -> None:
    schemas = {"go": Go}
    good = {"op": "go", "tokens": [1, 2], "kv": ["h", 80], "sub": {"name": "abc"}}
    assert validate(good, schemas) == ("go", good)
    for bad, why in [
        ({**good, "tokens": [1, 256]}, r"<= 255 - at `\$.tokens\[1\]`"),
        ({**good, "tokens": [1] * 5}, "length <= 4"),
        ({**good, "tokens": [True]}, "got `bool`"),
        ({**good, "kv": ["h", 0]}, r">= 1 - at `\$.kv\[1\]`"),
        ({**good, "kv": ["h"]}, "length 2"),
        ({**good, "rate": 2}, r"<= 1.0 - at `\$.rate`"),
        ({**good, "sub": {"name": "abcd"}}, "length <= 3"),
        ({**good, "sub": {"name": "a", "x": 1}}, "unknown field `x`"),
        ({k: v for k, v in good.items() if k != "kv"}, "missing required field `kv`"),
        ({**good, "op": "stop"}, "unknown op"),
        ({**good, "op": 3}, "unknown op"),
    ]:
        with pytest.raises(BadMessage, match=why):
            validate(bad, schemas)


def test_secret_from_a_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    path.write_text("  0123456789abcdef0123\n")
    path.chmod(0o600)
    assert load_secret(str(path)) == b"0123456789abcdef0123"
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by other users"):
        load_secret(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))
    assert load_secret(environ={SECRET_ENV.encode(): b"fedcba9876543210fedcba"}) == b"fedcba9876543210fedcba"
    with pytest.raises(ValueError, match="at least 16"):
        load_secret(environ={SECRET_ENV.encode(): b"short"})
    with pytest.raises(ValueError, match="--secret-file"):
        load_secret(environ={k: v for k, v in os.environb.items() if k != SECRET_ENV.encode()})
