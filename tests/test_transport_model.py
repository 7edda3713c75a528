"""Real model states over the transport: every preset, 1/2/8 connections, direct and through the emulator.

A state broken on purpose before it is sent decodes away from transformers' own generate(), so the
exactness checks against that reference (``model.reference``) can fail.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any

import pytest
import torch

from minifaas.emulator.emulator_process import EmulatorProcess
from minifaas.model.interleaved_decoder import DecodeStream
from minifaas.model.layer_state import LayerState, ModelState, StateKind
from minifaas.model.loader import DEFAULT_MODEL, preset_names
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.model.state_codec import same_state
from minifaas.transport.outgoing import KVSender, SenderConfig
from minifaas.transport.receiver import KVReceiver, ReceiverConfig

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
    local = DecodeStream(runtime, result.state, result.next_token, params).run()
    remote = DecodeStream(runtime, received, result.next_token, params).run()
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
                                out.put_threadsafe(layer.slice_tokens(start, end), start, 40)
                            elif end == 40:
                                out.put_threadsafe(layer)

                        state = runtime.prefill(ids[start:end], prefix_state=state, on_layer=on_layer).state
                    return state

                local = await asyncio.to_thread(prefill_in_chunks)
            return local, await rx.transfer(7).model_state()

    local, received = run(main())
    assert same_state(received, local)


def negated(state: LayerState) -> LayerState:
    """The sign bit of every element flipped: a state of the right size and layout that the model never made."""
    return LayerState(state.layer, state.kind, state.seq_len, tuple((name, -t) for name, t in state.slots))


@pytest.mark.parametrize("runtime", [DEFAULT_MODEL], indirect=True)
def test_a_layer_broken_before_the_sender_decodes_away_from_the_reference(runtime: ModelRuntime) -> None:
    """One linear-attention layer negated as the prefill hands it to a real sender crosses a real socket as
    sent, and the tokens decoded from it leave transformers' own generate(); the same transfer unbroken
    decodes to exactly those tokens."""
    ids, params = prompt(32), SamplingParams(max_tokens=12, ignore_eos=True)
    broken = max(i for i, kind in enumerate(runtime.layout.kinds) if kind is StateKind.LINEAR_ATTENTION)

    def as_sent(state: LayerState, corrupt: bool) -> LayerState:
        return negated(state) if corrupt and state.layer == broken else state

    async def transfer(corrupt: bool) -> tuple[Any, ModelState]:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            config = SenderConfig("127.0.0.1", rx.port, SECRET, connections=2, chunk_bytes=8192)
            incoming = rx.transfer(9)
            async with KVSender(config) as tx, asyncio.TaskGroup() as tg:
                receiving = tg.create_task(incoming.model_state())
                async with tx.stream(9, runtime.num_states) as out:

                    def on_layer(state: LayerState) -> None:
                        out.put_threadsafe(as_sent(state, corrupt))

                    result = await asyncio.to_thread(runtime.prefill, ids, on_layer=on_layer)
            return result, receiving.result()

    expected = reference_tokens(runtime, ids, params)
    for corrupt in (False, True):
        result, received = run(transfer(corrupt))
        sent = ModelState([as_sent(s, corrupt) for s in result.state.layers], result.state.seq_len)
        assert same_state(received, sent) and same_state(received, result.state) is not corrupt
        tokens = DecodeStream(runtime, received, result.next_token, params).run()
        assert (tokens == expected) is not corrupt, f"broken: {corrupt}, {tokens} against the reference {expected}"
