"""Real model states over the transport: every preset, 1/2/8 connections, direct and through the emulator."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any

import pytest
import torch

from minifaas.emulator.emulator_process import EmulatorProcess
from minifaas.model.loader import DEFAULT_MODEL, preset_names
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.transport.receiver import KVReceiver, ReceiverConfig
from minifaas.transport.sender import KVSender
from minifaas.transport.sender_config import SenderConfig
from minifaas.transport.synthetic import same_state

SECRET = b"cluster-secret-0123456789abcdef"
pytestmark = pytest.mark.timeout(120)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 100))


def prompt(length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()


@pytest.fixture(scope="module", params=preset_names())
def runtime(request: pytest.FixtureRequest) -> ModelRuntime:
    return ModelRuntime.load(request.param)


def test_prefilled_state_round_trips_bit_exact(runtime: ModelRuntime) -> None:
    state = runtime.prefill(prompt(24)).state

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx, EmulatorProcess(("127.0.0.1", rx.port)) as link:
            transfer_id = 0
            for port in (rx.port, link.port):
                for connections in (1, 2, 8):
                    config = SenderConfig("127.0.0.1", port, SECRET, connections=connections, chunk_bytes=4096)
                    async with KVSender(config) as tx:
                        transfer_id += 1
                        await tx.send(transfer_id, state)
                        got = await rx.transfer(transfer_id).model_state()
                    assert same_state(got, state), f"{connections} connections via port {port}"
                    assert got.seq_len == state.seq_len
            assert (await link.control.stats())["up_bytes"] > 3 * state.nbytes

    run(main())


@pytest.mark.parametrize("runtime", [DEFAULT_MODEL], indirect=True)
def test_layers_streamed_during_prefill_decode_like_the_local_state(runtime: ModelRuntime) -> None:
    """Prefill in a thread hands each layer to the sender as it finishes; decode continues from what arrived."""
    ids = prompt(32)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def main() -> tuple[Any, Any]:
        async with (
            KVReceiver(ReceiverConfig(SECRET)) as rx,
            EmulatorProcess(("127.0.0.1", rx.port), rate="50mbit", delay_ms=2) as link,
        ):
            config = SenderConfig("127.0.0.1", link.port, SECRET, connections=4, chunk_bytes=8192)
            incoming = rx.transfer(42)
            async with KVSender(config) as tx, asyncio.TaskGroup() as tg:
                receiving = tg.create_task(incoming.model_state())
                async with tx.stream(42, runtime.num_states) as out:
                    result = await asyncio.to_thread(runtime.prefill, ids, on_layer=out.put_threadsafe)
            return result, receiving.result()

    result, received = run(main())
    assert same_state(received, result.state)
    local = runtime.start_decode(result.state, result.next_token, params).run()
    remote = runtime.start_decode(received, result.next_token, params).run()
    assert remote == local


@pytest.mark.parametrize("runtime", [DEFAULT_MODEL], indirect=True)
def test_prefill_in_token_chunks_streams_full_attention_ranges(runtime: ModelRuntime) -> None:
    """Full-attention keys and values leave chunk by chunk; the receiver gets the same state as the last chunk's."""
    ids, bounds = prompt(40), (0, 15, 31, 40)

    async def main() -> tuple[Any, Any]:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            config = SenderConfig("127.0.0.1", rx.port, SECRET, connections=2, chunk_bytes=4096)
            async with KVSender(config) as tx, tx.stream(7, runtime.num_states) as out:

                def prefill_in_chunks() -> Any:
                    state = None
                    for start, end in itertools.pairwise(bounds):

                        def on_layer(layer: Any, start: int = start, end: int = end) -> None:
                            if layer.kind.grows:
                                out.put_tokens_threadsafe(layer.slice_tokens(start, end), start, 40)
                            elif end == 40:
                                out.put_threadsafe(layer)

                        state = runtime.prefill(ids[start:end], prefix_state=state, on_layer=on_layer).state
                    return state

                local = await asyncio.to_thread(prefill_in_chunks)
            return local, await rx.transfer(7).model_state()

    local, received = run(main())
    assert same_state(received, local)
