"""The prefill service's streaming with real models: chunked prefill on the wire rebuilds the computed state.

Prompts run through the prefix store (a hit, snapshot segments, then the rest)
in token chunks; full-attention KV leaves chunk by chunk, everything else at
the end, and the receiver's state is the one the prefill computed, bit for bit.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any

import pytest
import torch
from conftest import decodes_as_alone

from minifaas.cache.pool_config import PoolConfig
from minifaas.control.worker_ops import Prefill, Prefilled, Sampling
from minifaas.model.interleaved_decoder import DecodeStream
from minifaas.model.layer_state import LayerState, ModelState
from minifaas.model.loader import preset_names
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import GREEDY, SamplingParams
from minifaas.model.state_codec import same_state
from minifaas.model.state_layout import needs_snapshot
from minifaas.transport.outgoing import KVSender, SenderConfig
from minifaas.transport.receiver import KVReceiver, ReceiverConfig
from minifaas.worker.prefill_service import PrefillService, TransferSink
from minifaas.worker.prefix_store import PrefixStore

SECRET = b"cluster-secret-0123456789abcdef"
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
BLOCK = 16
pytestmark = pytest.mark.timeout(300)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 240))


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=preset_names())
def runtime(request: pytest.FixtureRequest) -> ModelRuntime:
    return ModelRuntime.load(request.param)


def store_for(runtime: ModelRuntime) -> PrefixStore:
    """Blocks of 16 tokens, a snapshot every 32: a prompt of 180 runs as several segments."""
    layout = runtime.layout.kinds
    return PrefixStore(PoolConfig("n", 1 << 30, BLOCK, 2, needs_snapshot(layout)), runtime.spec.name, layout, "n")


FIRST = prompt(150, 1)
SECOND = FIRST[:100] + prompt(80, 2)  # shares 100 tokens: a hit of 96 (a snapshot point) or 96 (full blocks)


def test_chunked_prefill_through_the_service_decodes_like_generate(runtime: ModelRuntime) -> None:
    async def main() -> list[tuple[Prefilled, ModelState]]:
        store = store_for(runtime)
        service = PrefillService(runtime, SECRET, 2, True, store, chunk_tokens=24)
        out = []
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            for i, tokens in enumerate([FIRST, SECOND]):
                msg = Prefill(req=f"r{i}", tokens=tokens, sampling=Sampling.of(PARAMS), transfer=i,
                              kv=["127.0.0.1", rx.port], link_start=0)  # fmt: skip
                out.append(await asyncio.gather(service.prefill(msg), rx.transfer(i).model_state()))
        await service.close()
        return out

    (cold, cold_state), (warm, warm_state) = run(main())
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 96)
    for tokens, reply, state in [(FIRST, cold, cold_state), (SECOND, warm, warm_state)]:
        assert reply.kv_bytes == state.nbytes and state.seq_len == len(tokens)
        decodes_as_alone(runtime, tokens, reply, state, PARAMS)


@pytest.mark.parametrize("link_start", [0, 130])
def test_streamed_pieces_rebuild_the_computed_state_bit_exact(runtime: ModelRuntime, link_start: int) -> None:
    """Segments after a hit, in chunks of 24; the decode node already holds the first ``link_start`` tokens."""
    store = store_for(runtime)
    first = store.begin(FIRST)
    store.finish(first, store.compute(runtime, first), 0.0)
    pieces: list[tuple[int, int, int, int]] = []  # (layer, start, end, total) of every token range put

    async def main() -> tuple[Any, ModelState, list[int]]:
        plan = store.begin(SECOND)
        assert plan.hit_tokens == 96
        segments = [96, *plan.points, len(SECOND)]  # each one forward's tokens, run in chunks of 24
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            config = SenderConfig("127.0.0.1", rx.port, SECRET, connections=2, chunk_bytes=4096)
            async with KVSender(config) as sender, sender.stream(5, runtime.num_states) as tx:

                class Recorded:  # the transfer, with every token range put in it noted
                    def put_threadsafe(self, piece: LayerState, start: int = 0, total: int | None = None) -> None:
                        if total is not None:
                            pieces.append((piece.layer, start, start + piece.seq_len, total))
                        tx.put_threadsafe(piece, start, total)

                sink = TransferSink(Recorded(), link_start, len(SECOND))  # type: ignore[arg-type]
                computed = await asyncio.to_thread(store.compute, runtime, plan, sink, GREEDY, 24)
            store.finish(plan, computed, 1.0)
            assert sink.nbytes > 0
            return computed, await rx.transfer(5).model_state(), segments

    computed, received, segments = run(main())
    final = computed.state
    expected = [s.slice_tokens(link_start, s.seq_len) if s.kind.grows else s for s in final.layers]
    assert same_state(received, ModelState(expected, max(s.seq_len for s in expected)))
    grows = [s.layer for s in final.layers if s.kind.grows]
    assert sorted({layer for layer, *_ in pieces}) == grows
    cuts = sorted({c for a, b in itertools.pairwise(segments) for c in range(a, b, 24)} - {96})
    bounds = [link_start, *(c for c in cuts if c > link_start), len(SECOND)]
    for layer in grows:
        ranges = [(a + link_start, b + link_start) for i, a, b, _ in pieces if i == layer]
        assert ranges == list(itertools.pairwise(bounds)), f"layer {layer}"
        assert {total for i, *_, total in pieces if i == layer} == {len(SECOND) - link_start}
    assert len(bounds) > 3


def test_an_aborted_prefill_stops_part_way_and_the_next_prompt_runs_alone() -> None:
    runtime = ModelRuntime.load("kimi-linear-tiny")
    long, short = prompt(2000, 3), prompt(40, 4)

    async def main() -> tuple[PrefillService, ModelState, Prefilled]:
        store = store_for(runtime)
        service = PrefillService(runtime, SECRET, 2, True, store, chunk_tokens=64)
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:

            def msg(req: str, tokens: list[int], transfer: int) -> Prefill:
                return Prefill(req=req, tokens=tokens, sampling=Sampling.of(PARAMS), transfer=transfer,
                               kv=["127.0.0.1", rx.port], link_start=0)  # fmt: skip

            running = asyncio.create_task(service.prefill(msg("long", long, 0)))
            queued = asyncio.create_task(service.prefill(msg("queued", long, 1)))
            while rx.stats.bytes_received == 0:  # the long prompt's first chunk is on the wire
                await asyncio.sleep(0.01)
            running.cancel()
            queued.cancel()
            for task in (running, queued):
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert not service.compute.locked() and service.queued_tokens == 0
            # the stopped forward's thread has ended: a prompt after it runs alone on the model
            reply, state = await asyncio.gather(service.prefill(msg("short", short, 2)), rx.transfer(2).model_state())
        await service.close()
        return service, state, reply

    service, state, reply = run(main())
    assert 0 < service.stopped_at["long"] < len(long), service.stopped_at
    assert service.stopped_at["queued"] == 0
    plan = service.store.begin(long)  # nothing of the stopped prompt went into the pool
    service.store.release(plan)
    assert plan.hit_tokens == 0
    assert DecodeStream(runtime, state, reply.next_token, PARAMS).run() == reference_tokens(runtime, short, PARAMS)


def test_a_prompts_blocks_are_stored_after_its_reply_and_before_the_next_prompt_computes() -> None:
    runtime = ModelRuntime.load("kimi-linear-tiny")
    tokens = prompt(200, 5)

    async def main() -> tuple[list[Prefilled], list[int], list[str]]:
        service = PrefillService(runtime, SECRET, 2, True, store_for(runtime), chunk_tokens=64)
        stored: list[int] = []
        news: list[str] = []

        def kept() -> None:  # what the session would send: the pool's size and news after each store
            stored.append(len(service.store.pool.entries()))
            news.extend(e.kind.value for e in service.store.pool.drain_events())

        service.kept = kept
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            replies = []
            for transfer in (0, 1):  # the same prompt twice, the second sent the moment the first is answered
                msg = Prefill(req=f"r{transfer}", tokens=tokens, sampling=Sampling.of(PARAMS), transfer=transfer,
                              kv=["127.0.0.1", rx.port], link_start=0)  # fmt: skip
                reply, _ = await asyncio.gather(service.prefill(msg), rx.transfer(transfer).model_state())
                replies.append(reply)
            await service.close()  # waits for the last store
        assert not service.compute.locked() and service.queued_tokens == 0
        return replies, stored, news

    (first, second), stored, news = run(main())
    # the first prompt's blocks and end snapshot were in the pool when the second took its turn: a hit of the
    # whole prompt, nothing computed
    assert first.cached_tokens == 0 and second.cached_tokens == len(tokens)
    assert (first.computed_tokens, second.computed_tokens) == (len(tokens), 0)
    assert second.next_token == first.next_token
    assert len(stored) == 2 and stored[0] > 0  # each store told the session once, after it was done
    assert "store" in news
