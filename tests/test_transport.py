"""Sender and receiver over real loopback sockets: round trips, ordering, pipelining, off switches, TLS."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import ssl
import subprocess
import threading
from collections.abc import Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from synthetic import bulk_state, synthetic_state

from minifaas.emulator.emulator_process import EmulatorProcess
from minifaas.model.state_codec import same_state
from minifaas.net.errors import AuthError, ProtocolError, TransferError
from minifaas.transport.outgoing import MIN_UNSENT_BYTES, KVSender, SenderConfig
from minifaas.transport.receiver import KVReceiver, ReceiverConfig
from minifaas.transport.wire import cut_tail, split_chunks

SECRET = b"cluster-secret-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 45))


def sender_config(port: int, **changes: Any) -> SenderConfig:
    return SenderConfig("127.0.0.1", port, SECRET, **{"chunk_bytes": 2048, "stall_timeout": 5.0, **changes})


@pytest.mark.parametrize("connections", [1, 2, 8])
@pytest.mark.parametrize("via_emulator", [False, True])
def test_round_trip_is_bit_exact(connections: int, via_emulator: bool) -> None:
    state = synthetic_state(layers=8, tokens=96, width=16, seed=connections)

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            if via_emulator:
                async with EmulatorProcess(("127.0.0.1", rx.port), rate="200mbit", delay_ms=2, jitter_ms=1) as link:
                    await transfer_twice(link.port, rx)
                    assert (await link.control.stats())["up_bytes"] > 2 * state.nbytes
            else:
                await transfer_twice(rx.port, rx)

    async def transfer_twice(port: int, rx: KVReceiver) -> None:
        async with KVSender(sender_config(port, connections=connections)) as tx:
            for transfer_id in (11, 12):  # the second transfer reuses the pooled connections
                report = await tx.send(transfer_id, state)
                assert report.nbytes == state.nbytes and report.connections == connections
                assert same_state(await rx.transfer(transfer_id).model_state(), state)
            assert tx.pool.dialled == connections

    run(main())


@pytest.mark.parametrize("connections", [1, 3])
def test_big_chunks_checked_off_the_event_loop_round_trip(connections: int) -> None:
    state = bulk_state(6 << 20, layers=3)  # 1 MiB slots, checksummed in threads on both sides

    async def main() -> None:
        async with (
            KVReceiver(ReceiverConfig(SECRET)) as rx,
            KVSender(sender_config(rx.port, connections=connections, chunk_bytes=512 << 10)) as tx,
        ):
            for transfer_id in (1, 2):
                await tx.send(transfer_id, state)
                got = await rx.transfer(transfer_id).model_state()
                assert same_state(got, state)
                rx.release(got)  # the second transfer lands in recycled memory
            assert rx.buffers.reused > 0

    run(main())


def covered(chunks: list[Any]) -> list[tuple[int, int, int]]:
    """Every 4 KiB position the chunks write, in the order they write it: (layer, slot, offset)."""
    return [(c.state.layer, c.slot, at) for c in chunks for at in range(c.offset, c.offset + c.length, 4096)]


def test_the_last_chunks_are_cut_small_so_the_connections_end_together() -> None:
    state = bulk_state(10 << 20, layers=5)  # ten 1 MiB slots
    chunks = [c for layer in state.layers for c in split_chunks(layer, 1 << 20)]
    cut = cut_tail(chunks, connections=2, piece_bytes=256 << 10)
    assert [c.length for c in cut] == [1 << 20] * 8 + [256 << 10] * 8  # two connections: the last 2 MiB cut
    assert covered(cut) == covered(chunks)  # the same bytes, in the same order
    assert cut_tail(chunks, connections=1, piece_bytes=256 << 10) == chunks  # one connection ends with itself
    assert cut_tail(chunks, connections=4, piece_bytes=None) == chunks  # no unsent limit: no cut either


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_state_whose_last_chunks_were_cut_arrives_bit_exact(pipelined: bool) -> None:
    state = bulk_state(3 << 20, layers=3)

    async def main() -> None:
        config = sender_config(0, connections=4, chunk_bytes=1 << 20, unsent_bytes=512 << 10, pipelined=pipelined)
        assert config.unsent_limit_bytes == 128 << 10  # the budget shared out: the pieces at the end
        async with KVReceiver(ReceiverConfig(SECRET)) as rx, KVSender(replace(config, port=rx.port)) as tx:
            await tx.send(1, state)
            assert same_state(await rx.transfer(1).model_state(), state)

    run(main())


def test_the_unsent_budget_is_shared_out_over_the_connections() -> None:
    assert sender_config(1, connections=4).unsent_limit_bytes == 1 << 20  # 4 MiB over 4, as before
    assert sender_config(1, connections=16).unsent_limit_bytes == 256 << 10
    assert sender_config(1, connections=64).unsent_limit_bytes == 64 << 10
    assert sender_config(1, connections=4, unsent_bytes=MIN_UNSENT_BYTES).unsent_limit_bytes == MIN_UNSENT_BYTES
    assert sender_config(1, unsent_bytes=None).unsent_limit_bytes is None
    with pytest.raises(ValueError, match="unsent_bytes"):
        sender_config(1, unsent_bytes=MIN_UNSENT_BYTES - 1)


def test_chunks_are_striped_over_every_connection() -> None:
    state = synthetic_state(layers=8, tokens=256, width=32)

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx, KVSender(sender_config(rx.port, connections=4)) as tx:
            await tx.send(1, state)
            acked = [info.bytes_acked for info in tx.tcp_infos().values()]
            assert len(acked) == 4 and min(acked) > 4 * 2048  # each carried several chunks
            await rx.transfer(1).model_state()

    run(main())


@pytest.mark.parametrize("connections", [1, 3])
def test_layers_are_delivered_in_order_each_as_soon_as_it_is_complete(connections: int) -> None:
    """The producer emits layer i+1 only after the consumer has received layer i: no batching at the end."""
    state = synthetic_state(layers=8, tokens=64, width=16)

    async def main() -> None:
        async with (
            KVReceiver(ReceiverConfig(SECRET)) as rx,
            KVSender(sender_config(rx.port, connections=connections)) as tx,
        ):
            got: list[int] = []
            arrived = [asyncio.Event() for _ in state.layers]

            async def consume() -> None:
                async for layer in rx.transfer(5):
                    got.append(layer.layer)
                    arrived[layer.layer].set()

            async with asyncio.TaskGroup() as tg:
                tg.create_task(consume())
                async with tx.stream(5, len(state.layers), state.nbytes) as out:
                    for layer in state.layers:
                        out.put(layer)
                        await asyncio.wait_for(arrived[layer.layer].wait(), 10)
            assert got == list(range(8))

    run(main())


def test_without_pipelining_nothing_moves_until_the_state_is_whole() -> None:
    state = synthetic_state(layers=4, tokens=32, width=8)

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx, KVSender(sender_config(rx.port, pipelined=False)) as tx:
            incoming = rx.transfer(9)
            async with tx.stream(9, 4) as out:
                for layer in state.layers[:3]:
                    out.put(layer)
                await asyncio.sleep(0.3)  # give a (wrongly) eager sender time to send
                assert out.sent_bytes == 0 and incoming.layers == 0 and rx.stats.bytes_received == 0
                out.put(state.layers[3])
            assert same_state(await incoming.model_state(), state)

    run(main())


def test_full_attention_layers_put_as_token_ranges_arrive_whole() -> None:
    state = synthetic_state(layers=8, tokens=90, width=16)
    cuts = (0, 30, 61, 90)

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx, KVSender(sender_config(rx.port, connections=3)) as tx:
            async with tx.stream(8, len(state.layers)) as out:
                for start, end in itertools.pairwise(cuts):  # as a prefill in three token chunks would
                    for layer in state.layers:
                        if layer.kind.grows:
                            out.put(layer.slice_tokens(start, end), start, 90)
                        elif end == 90:
                            out.put(layer)
            assert same_state(await rx.transfer(8).model_state(), state)

    run(main())


def test_layers_put_from_another_thread() -> None:
    state = synthetic_state(layers=8, tokens=64, width=16)

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx, KVSender(sender_config(rx.port)) as tx:
            async with tx.stream(3, len(state.layers)) as out:
                producer = threading.Thread(target=lambda: [out.put_threadsafe(layer) for layer in state.layers])
                producer.start()
                await asyncio.to_thread(producer.join, 10)
            assert same_state(await rx.transfer(3).model_state(), state)

    run(main())


@pytest.mark.parametrize("mistake", ["twice", "beyond", "missing"])
def test_putting_a_layer_twice_beyond_the_count_or_not_at_all_is_refused(mistake: str) -> None:
    state = synthetic_state(layers=3)

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx, KVSender(sender_config(rx.port)) as tx:
            with pytest.raises(ValueError):
                async with tx.stream(4, 2) as out:
                    out.put(state.layers[0])
                    if mistake != "missing":
                        out.put(state.layers[0 if mistake == "twice" else 2])

    run(main())


def test_many_transfers_at_once_share_the_receiver() -> None:
    states = [synthetic_state(layers=8, tokens=32, width=8, seed=i) for i in range(6)]

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx, KVSender(sender_config(rx.port, connections=2)) as tx:
            async with asyncio.TaskGroup() as tg:
                for i, s in enumerate(states):
                    tg.create_task(tx.send(100 + i, s))
            for i, s in enumerate(states):
                assert same_state(await rx.transfer(100 + i).model_state(), s)
            assert rx.stats.completed == 6

    run(main())


def test_payloads_without_checksums_only_where_the_receiver_allows_them() -> None:
    state = synthetic_state(layers=4, tokens=32, width=8)

    async def main() -> None:
        lenient = ReceiverConfig(SECRET, accept_unchecked=True)
        async with KVReceiver(lenient) as rx, KVSender(sender_config(rx.port, checksums=False)) as tx:
            await tx.send(1, state)
            assert same_state(await rx.transfer(1).model_state(), state)
        strict = ReceiverConfig(SECRET, stall_timeout=1.0)
        async with KVReceiver(strict) as rx, KVSender(sender_config(rx.port, checksums=False, done_timeout=2)) as tx:
            incoming = rx.transfer(2)
            with pytest.raises(TransferError):
                await tx.send(2, state)
            with pytest.raises(ProtocolError):
                await incoming.model_state()

    run(main())


def test_wrong_secret_on_either_side_is_refused() -> None:
    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            async with KVSender(SenderConfig("127.0.0.1", rx.port, b"not-the-secret-0123456789")) as tx:
                with pytest.raises(AuthError):
                    await tx.send(1, synthetic_state(layers=2))
            assert rx.stats.auth_failures >= 1 and rx.stats.bytes_received == 0
        rogue_config = ReceiverConfig(b"rogue-receiver-secret-0123")
        async with KVReceiver(rogue_config) as rogue, KVSender(sender_config(rogue.port)) as tx:
            with pytest.raises(AuthError):
                await tx.send(1, synthetic_state(layers=2))

    run(main())


def test_a_sender_that_leaves_during_the_handshake_is_no_auth_failure(caplog: pytest.LogCaptureFixture) -> None:
    """What an aborted transfer's connections do: open, read the receiver's hello, and close without answering."""

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", rx.port)
                await reader.readexactly(1)  # the hello has begun
                writer.transport.abort()  # a reset, as a cancelled sender's socket gives
            while sum("closed before it carried a frame" in r.getMessage() for r in caplog.records) < 3:
                await asyncio.sleep(0.01)
            assert rx.stats.auth_failures == 0
            async with KVSender(sender_config(rx.port)) as tx:  # and the receiver serves the next one
                incoming = rx.transfer(1)
                await tx.send(1, synthetic_state(layers=2))
                assert same_state(await incoming.model_state(), synthetic_state(layers=2))

    with caplog.at_level("DEBUG", logger="minifaas.transport.receiver"):
        run(main())
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text


@pytest.mark.parametrize("abandoned", [True, False])
def test_a_sender_that_goes_mid_transfer_is_a_warning_unless_its_consumer_left(
    abandoned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """An aborted request: the decode side stops waiting for its state, then the prefill's sender hangs up
    mid-transfer. That failure is expected (debug); the same hang-up under a transfer still wanted warns."""
    state = bulk_state(4 << 20, layers=4)

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            async with EmulatorProcess(("127.0.0.1", rx.port), rate="20mbit") as link:
                incoming = rx.transfer(7)
                if abandoned:
                    incoming.abandon()
                async with KVSender(sender_config(link.port, connections=2)) as tx:
                    sending = asyncio.create_task(tx.send(7, state))
                    while not incoming.started:
                        await asyncio.sleep(0.01)
                    sending.cancel()
                    await asyncio.gather(sending, return_exceptions=True)
                while incoming.error is None:  # the sender's connections closed with it
                    await asyncio.sleep(0.01)
            assert rx.stats.failed == 1

    with caplog.at_level("DEBUG", logger="minifaas.transport.receiver"):
        run(main())
    failed = [r for r in caplog.records if "transfer 7 failed" in r.getMessage()]
    assert [r.levelname for r in failed] == ["DEBUG" if abandoned else "WARNING"], caplog.text


def _self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


def tls_contexts(directory: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a fresh self-signed certificate for 127.0.0.1, and a client that trusts it."""
    cert, key = _self_signed(directory)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    return server_ctx, ssl.create_default_context(cafile=str(cert))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate")
def test_round_trip_over_tls(tmp_path: Path) -> None:
    server_ctx, client_ctx = tls_contexts(tmp_path)
    state = synthetic_state(layers=8, tokens=64, width=16)

    async def main() -> None:
        async with (
            KVReceiver(ReceiverConfig(SECRET), ssl=server_ctx) as rx,
            KVSender(sender_config(rx.port, connections=2), ssl=client_ctx) as tx,
        ):
            await tx.send(1, state)
            assert same_state(await rx.transfer(1).model_state(), state)

    run(main())
