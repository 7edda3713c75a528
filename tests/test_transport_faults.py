"""Every way a transfer can break ends it with a specific error, in bounded time, and frees its state."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
from synthetic import bulk_state, synthetic_state

from minifaas.emulator.emulator_process import EmulatorProcess
from minifaas.model.state_codec import same_state
from minifaas.net.channel import Channel, open_channel
from minifaas.net.connections import prove_as_sender
from minifaas.net.errors import (
    ConnectionLostError,
    CorruptFrameError,
    ProtocolError,
    RejectedError,
    StallError,
    TransferAbortedError,
    TransferError,
    TruncatedError,
)
from minifaas.transport.outgoing import KVSender, SenderConfig
from minifaas.transport.receiver import IncomingTransfer, KVReceiver, ReceiverConfig
from minifaas.transport.wire import FrameHeader, FrameType, control, pack_counts, split_chunks

SECRET = b"cluster-secret-0123456789abcdef"
STALL = 1.0  # seconds without progress before a side gives up
pytestmark = pytest.mark.timeout(60)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 45))


async def failure_of(incoming: IncomingTransfer) -> TransferError:
    with pytest.raises(TransferError) as caught:
        async with asyncio.timeout(4 * STALL + 5):
            await incoming.model_state()
    assert incoming.assembly is None  # the partial state is gone
    return caught.value


async def dropped(channel: Channel) -> bool:
    """The receiver hung up on this connection (an orderly close or a reset)."""
    try:
        return not await channel.recv_into(memoryview(bytearray(1)), 5)
    except ConnectionLostError:
        return True


async def raw_sender(port: int) -> Channel:
    channel = await open_channel("127.0.0.1", port, 5.0)
    await prove_as_sender(channel, SECRET, 5.0)
    return channel


# --- faults injected by the link emulator in the middle of a real transfer ---

BIG = synthetic_state(layers=8, tokens=2048, width=32)  # ~1.5 MB: over a second at 8 Mbit/s


async def through_slow_link(fault: str) -> tuple[BaseException, TransferError]:
    async with (
        KVReceiver(ReceiverConfig(SECRET, stall_timeout=STALL)) as rx,
        EmulatorProcess(("127.0.0.1", rx.port), rate="8mbit") as link,
    ):
        config = SenderConfig("127.0.0.1", link.port, SECRET, connections=2, chunk_bytes=16 << 10,
                              stall_timeout=STALL, done_timeout=2 * STALL)  # fmt: skip
        incoming = rx.transfer(1)
        async with KVSender(config) as tx, asyncio.TaskGroup() as tg:
            sending = tg.create_task(_outcome(tx.send(1, BIG)))
            async with asyncio.timeout(20):
                await anext(aiter(incoming))  # layer 0 is through: the transfer is under way
            await link.control.command(fault, **({"seconds": 60} if fault == "stall" else {}))
            receiver_error = await failure_of(incoming)
        return sending.result(), receiver_error


async def _outcome(coro: Coroutine[Any, Any, Any]) -> BaseException:
    try:
        await coro
    except TransferError as e:
        return e
    raise AssertionError("the transfer should have failed")


def test_connection_cut_mid_transfer() -> None:
    sender_error, receiver_error = run(through_slow_link("cut"))
    assert isinstance(sender_error, (ConnectionLostError, TruncatedError, RejectedError))
    assert isinstance(receiver_error, (ConnectionLostError, TruncatedError))


def test_stalled_link() -> None:
    sender_error, receiver_error = run(through_slow_link("stall"))
    assert isinstance(sender_error, StallError)
    assert isinstance(receiver_error, StallError)


@pytest.mark.parametrize("done_timeout", [10 * STALL, STALL], ids=["done-later", "done-within-a-stall"])
def test_a_slow_link_is_not_a_stalled_one(done_timeout: float) -> None:
    """Each chunk takes longer than the stall deadline to arrive, but its bytes keep coming: no StallError.
    (The receiver is woken only once a whole chunk is in, SO_RCVLOWAT, so progress has to be asked for.) END
    leaves seconds before the link has carried what the sender's kernel queued: DONE is due ``done_timeout``
    after the link has taken the last byte, not after END."""

    async def scenario() -> None:
        state = bulk_state(100_000, layers=2)  # 4 chunks of 25 KB, each ~1.25 s at 160 kbit/s > STALL
        async with (
            KVReceiver(ReceiverConfig(SECRET, stall_timeout=STALL)) as rx,
            EmulatorProcess(("127.0.0.1", rx.port), rate="160kbit") as link,
        ):
            config = SenderConfig("127.0.0.1", link.port, SECRET, connections=1, stall_timeout=STALL,
                                  done_timeout=done_timeout)  # fmt: skip
            incoming = rx.transfer(1)
            async with KVSender(config) as tx:
                report = await tx.send(1, state)
            assert report.nbytes == sum(t.nbytes for layer in state.layers for _, t in layer.slots)
            assert same_state(await incoming.model_state(), state)

    run(scenario())


def test_a_slow_producer_is_not_a_stalled_sender() -> None:
    """Prefill takes longer than the stall deadline between two layers (a long chunk on a busy host): the
    sender's ALIVE frames keep the transfer open, and it completes whole."""
    state = synthetic_state(layers=3, tokens=64, width=8)

    async def scenario() -> None:
        async with KVReceiver(ReceiverConfig(SECRET, stall_timeout=STALL)) as rx:
            incoming = rx.transfer(1)
            config = SenderConfig("127.0.0.1", rx.port, SECRET, connections=2, stall_timeout=STALL)
            async with KVSender(config) as tx, tx.stream(1, layers=3) as out:
                for layer in state.layers:
                    out.put(layer)
                    await asyncio.sleep(2.5 * STALL)  # the producer's next layer is this far off
            assert out.report is not None and out.report.layers == 3
            assert same_state(await incoming.model_state(), state)
            assert rx.stats.failed == 0

    run(scenario())


def test_byte_corrupted_on_the_link() -> None:
    sender_error, receiver_error = run(through_slow_link("corrupt"))
    assert isinstance(receiver_error, (CorruptFrameError, ProtocolError))
    assert isinstance(sender_error, (RejectedError, ConnectionLostError))


# --- a hand-made sender that breaks the stream in exact places ---


def first_chunk() -> tuple[bytes, memoryview]:
    return split_chunks(synthetic_state(layers=2, tokens=16).layers[0], 1 << 20)[0].frame(7)


def test_corrupted_payload_byte_fails_the_transfer_and_drops_the_connection() -> None:
    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET, stall_timeout=STALL)) as rx:
            channel = await raw_sender(rx.port)
            header, payload = first_chunk()
            damaged = bytearray(payload)
            damaged[3] ^= 0x01
            await channel.send([control(FrameType.START, 7, pack_counts(2, 0)), header, damaged], 5)
            assert isinstance(await failure_of(rx.transfer(7)), CorruptFrameError)
            assert await dropped(channel)
            channel.close()

    run(main())


def test_corrupted_last_byte_of_a_big_chunk_received_in_several_reads() -> None:
    """The receiver checksums a payload block by block as it reads it: the last block counts too."""
    state = bulk_state(2 << 20, layers=1)

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET, stall_timeout=STALL)) as rx:
            channel = await raw_sender(rx.port)
            header, payload = split_chunks(state.layers[0], 1 << 20)[0].frame(7)
            damaged = bytearray(payload)
            damaged[-1] ^= 0x80
            await channel.send([header, damaged[: 300 << 10]], 5)
            await channel.send([damaged[300 << 10 :]], 5)
            assert isinstance(await failure_of(rx.transfer(7)), CorruptFrameError)
            assert await dropped(channel)
            channel.close()

    run(main())


def test_truncated_stream() -> None:
    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET, stall_timeout=STALL)) as rx:
            channel = await raw_sender(rx.port)
            header, payload = first_chunk()
            await channel.send([header, payload[: len(payload) // 2]], 5)
            channel.sock.shutdown(2)  # the stream ends in the middle of the payload
            assert isinstance(await failure_of(rx.transfer(7)), TruncatedError)
            channel.close()

    run(main())


def test_stream_ending_between_frames_before_the_end() -> None:
    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET, stall_timeout=STALL)) as rx:
            channel = await raw_sender(rx.port)
            await channel.send(list(first_chunk()), 5)
            channel.close()
            assert isinstance(await failure_of(rx.transfer(7)), TruncatedError)

    run(main())


def test_silent_sender_is_a_stall() -> None:
    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET, stall_timeout=STALL)) as rx:
            channel = await raw_sender(rx.port)
            await channel.send(list(first_chunk()), 5)  # then nothing, with the connection open
            assert isinstance(await failure_of(rx.transfer(7)), StallError)
            channel.close()

    run(main())


@pytest.mark.parametrize("damage", ["magic", "version", "huge slot"])
def test_bad_header_drops_the_connection(damage: str) -> None:
    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET, stall_timeout=STALL)) as rx:
            channel = await raw_sender(rx.port)
            header, payload = first_chunk()
            await channel.send([header, payload], 5)  # the transfer is open on this connection
            bad = bytearray(FrameHeader(FrameType.CHUNK, 7, 8, 0, 1, 1, 0, 2, "keys", 1, (1 << 30, 1 << 30)).pack())
            if damage == "magic":
                bad[0:4] = b"HTTP"
            elif damage == "version":
                bad[4] = 99
            await channel.send([bad], 5)
            assert isinstance(await failure_of(rx.transfer(7)), ProtocolError)
            assert await dropped(channel)
            channel.close()

    run(main())


def test_abort_from_the_sender() -> None:
    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET, stall_timeout=STALL)) as rx:
            channel = await raw_sender(rx.port)
            await channel.send([*first_chunk(), control(FrameType.ABORT, 7, b"prefill node lost its GPU")], 5)
            error = await failure_of(rx.transfer(7))
            assert isinstance(error, TransferAbortedError) and "GPU" in str(error)
            channel.close()

    run(main())


def test_receiver_gone_before_the_transfer() -> None:
    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            port = rx.port
        async with KVSender(SenderConfig("127.0.0.1", port, SECRET, connect_timeout=2)) as tx:
            with pytest.raises(ConnectionLostError):
                await tx.send(1, synthetic_state(layers=2))

    run(main())
