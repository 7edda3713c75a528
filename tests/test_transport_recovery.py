"""The transport recovers from what a restart or a hostile peer leaves behind, over real loopback sockets.

Transfers nobody claims (a prefill that completed into a restarted decode worker, or a sender
that holds the secret and floods the receiver) never wedge the receiver; pooled connections to a
receiver that restarted on the same port are not reused dead.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import ssl
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from synthetic import synthetic_state
from test_transport import _self_signed

from minifaas.model.interleaved_decoder import DecodeStream
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.model.state_codec import same_state
from minifaas.net.channel import open_channel
from minifaas.net.connections import prove_as_sender
from minifaas.net.errors import DroppedError
from minifaas.transport.outgoing import KVSender, SenderConfig
from minifaas.transport.receiver import KVReceiver, ReceiverConfig
from minifaas.transport.wire import FrameType, control, pack_counts

SECRET = b"cluster-secret-0123456789abcdef"
PROMPT = [(5 * i + 2) % 256 for i in range(48)]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
pytestmark = pytest.mark.timeout(120)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 90))


@pytest.fixture(scope="module")
def runtime() -> ModelRuntime:
    return ModelRuntime.load("kimi-linear-tiny")


async def decodes_like_generate(rx: KVReceiver, runtime: ModelRuntime, transfer_id: int) -> None:
    """A normal request: its prefilled state crosses the transport and decodes as transformers' generate() does."""
    result = runtime.prefill(PROMPT, sampling=PARAMS)
    incoming = rx.transfer(transfer_id)
    async with KVSender(SenderConfig("127.0.0.1", rx.port, SECRET, connections=2)) as tx:
        await tx.send(transfer_id, result.state)
    state = await incoming.model_state()
    tokens = DecodeStream(runtime, state, result.next_token, PARAMS).run()
    assert tokens == reference_tokens(runtime, PROMPT, PARAMS)


def test_hundreds_of_unclaimed_transfers_do_not_wedge_the_receiver(
    runtime: ModelRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    small = synthetic_state(layers=4, tokens=8, width=4)

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            async with KVSender(SenderConfig("127.0.0.1", rx.port, SECRET, connections=1)) as tx:
                for transfer_id in range(1, 301):  # completed, and never claimed by anyone
                    await tx.send(transfer_id, small)
            assert rx.stats.completed == 300 and rx.stats.dropped == 300 - 256
            late = rx.transfer(1)  # the oldest made room: its consumer learns why at once
            with pytest.raises(DroppedError, match="unclaimed when the table of 256 transfers was full"):
                await late.model_state()
            await decodes_like_generate(rx, runtime, 1000)

    with caplog.at_level(logging.WARNING, logger="minifaas.transport.receiver"):
        run(main())
    assert "transfer 1 was dropped: ended and unclaimed when the table of 256 transfers was full" in caplog.text


def test_unfinished_unclaimed_transfers_give_way_to_a_new_one(runtime: ModelRuntime) -> None:
    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET, stall_timeout=30)) as rx:
            flood = await open_channel("127.0.0.1", rx.port, 5.0)
            await prove_as_sender(flood, SECRET, 5.0)
            starts = [control(FrameType.START, 5000 + i, pack_counts(8, 1 << 20)) for i in range(300)]
            await flood.send(starts, 5)  # 300 transfers opened, none ever ends
            await decodes_like_generate(rx, runtime, 1)  # long before any of them stalls
            assert rx.stats.dropped >= 300 - 256 + 1
            flood.close()

    run(main())


def test_an_ended_transfer_nobody_claims_is_dropped_after_the_grace(caplog: pytest.LogCaptureFixture) -> None:
    state = synthetic_state(layers=4, tokens=64, width=8)

    async def main() -> None:
        config = ReceiverConfig(SECRET, stall_timeout=1.0, unclaimed_grace=0.5)
        async with KVReceiver(config) as rx, KVSender(SenderConfig("127.0.0.1", rx.port, SECRET)) as tx:
            await tx.send(7, state)
            async with asyncio.timeout(10):
                while rx.stats.dropped == 0:
                    await asyncio.sleep(0.05)
            assert rx.buffers.held_bytes >= state.nbytes  # its memory went back for the next transfer
            with pytest.raises(DroppedError, match="no consumer claimed it"):
                await rx.transfer(7).model_state()
            incoming = rx.transfer(8)
            await tx.send(8, state)
            assert same_state(await incoming.model_state(), state)

    with caplog.at_level(logging.WARNING, logger="minifaas.transport.receiver"):
        run(main())
    assert "transfer 7 was dropped: ended" in caplog.text and "no consumer claimed it" in caplog.text


@pytest.mark.parametrize("tls", [False, True])
def test_pooled_connections_to_a_receiver_that_restarted_on_the_same_port_are_not_reused(
    tls: bool, tmp_path: Path
) -> None:
    state = synthetic_state(layers=8, tokens=64, width=8)
    server_ctx = client_ctx = None
    if tls:
        if shutil.which("openssl") is None:
            pytest.skip("needs the openssl command to make a test certificate")
        cert, key = _self_signed(tmp_path)
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(cert, key)
        client_ctx = ssl.create_default_context(cafile=str(cert))

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET), ssl=server_ctx) as first:
            port = first.port
            tx = KVSender(SenderConfig("127.0.0.1", port, SECRET, connections=4, chunk_bytes=1024), ssl=client_ctx)
            incoming = first.transfer(1)
            await tx.send(1, state)
            assert same_state(await incoming.model_state(), state) and tx.pool.dialled == 4
            incoming = first.transfer(2)  # an idle connection that is fine is reused
            await tx.send(2, state)
            assert same_state(await incoming.model_state(), state) and tx.pool.dialled == 4
        async with KVReceiver(ReceiverConfig(SECRET, port=port), ssl=server_ctx) as restarted:  # idle ones died
            incoming = restarted.transfer(3)
            await tx.send(3, state)
            assert same_state(await incoming.model_state(), state)
            assert tx.pool.stale == 4 and tx.pool.dialled == 8
            incoming = restarted.transfer(4)  # and the new ones are reused as before
            await tx.send(4, state)
            assert same_state(await incoming.model_state(), state) and tx.pool.dialled == 8
        tx.pool.close()

    run(main())


def test_a_first_send_that_fails_on_a_reused_connection_is_redone_once_on_a_new_one() -> None:
    state = synthetic_state(layers=8, tokens=64, width=8)

    async def main() -> None:
        async with (
            KVReceiver(ReceiverConfig(SECRET)) as rx,
            KVSender(SenderConfig("127.0.0.1", rx.port, SECRET, connections=2, chunk_bytes=1024)) as tx,
        ):
            incoming = rx.transfer(1)
            await tx.send(1, state)
            assert same_state(await incoming.model_state(), state)
            for channel in tx.pool.live.values():  # each looks quiet to the check, but its way out is gone
                channel.sock.shutdown(socket.SHUT_WR)
            incoming = rx.transfer(2)
            await tx.send(2, state)  # no await since the shutdown: the receiver has not answered the FIN yet
            assert same_state(await incoming.model_state(), state)
            assert tx.pool.stale == 2 and tx.pool.dialled == 4

    run(main())
