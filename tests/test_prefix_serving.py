"""Prefix caching in the running system: real worker processes, the gateway's directory, cache-aware routing,
and incremental transfer to a decode node that holds the prefix."""

from __future__ import annotations

import asyncio
import time

from minifaas.model.layer_state import StateKind
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.serve.config import CacheConfig, ClusterConfig, LinkConfig, ServeConfig
from minifaas.serve.gateway import Gateway
from minifaas.serve.requests import GenerateRequest, RequestRecord

THRESHOLD = 200
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
LONG = [(13 * i + 5) % 256 for i in range(1500)]
SHORT_A = [(7 * i + 1) % 256 for i in range(150)]
SHORT_B = [(11 * i + 3) % 256 for i in range(150)]
MORE = [(5 * i + 2) % 256 for i in range(100)]


async def _run(gw: Gateway, rid: str, ids: list[int]) -> tuple[list[int], RequestRecord, float]:
    record = RequestRecord(rid, len(ids))
    start = time.perf_counter()
    tokens = [e.token_id async for e in gw.stream(GenerateRequest(rid, ids, PARAMS), record)]
    return tokens, record, time.perf_counter() - start


def test_repeated_and_extended_prompts_hit_the_cache_on_the_node_that_holds_it() -> None:
    rt = ModelRuntime.load("kimi-linear-tiny")
    prompts = {"long": LONG, "a": SHORT_A, "b": SHORT_B, "b+": SHORT_B + MORE}
    reference = {name: rt.generate(ids, PARAMS) for name, ids in prompts.items()}
    long_state = rt.prefill(LONG).state
    kv_per_token = long_state.bytes_by_kind()[StateKind.FULL_ATTENTION] // len(LONG)
    config = ServeConfig(
        threshold=THRESHOLD,
        pd=ClusterConfig(prefill_workers=2, decode_workers=1),
        link=LinkConfig(rate="50mbit", delay_ms=2.0),
        cache=CacheConfig(block_size=32, snapshot_interval_blocks=4),
    )

    async def scenario() -> None:
        async with Gateway(config) as gw:
            cold, rec1, _ = await _run(gw, "long1", LONG)
            warm, rec2, _ = await _run(gw, "long2", LONG)
            print(f"same {len(LONG)}-token prompt twice: TTFT {rec1.ttft_s:.3f} s cold, {rec2.ttft_s:.3f} s warm")
            assert cold == warm == reference["long"]
            assert (rec1.route, rec1.cached_tokens) == ("prfaas", 0)
            # the last snapshot before the prompt's end (every 4 blocks of 32): 1408 of 1500 tokens
            assert (rec2.route, rec2.prefill_worker, rec2.cached_tokens) == ("prfaas", "prfaas-p0", 1408)
            # the decode node kept the first state's KV: only the tokens after its last whole block cross the link
            assert rec1.kv_bytes == long_state.nbytes
            assert rec2.kv_bytes == long_state.nbytes - 1472 * kv_per_token

            # two short prompts at once land on different PD-P nodes; each node keeps its own prefix
            (out_a, rec_a, _), (out_b, rec_b, _) = await asyncio.gather(_run(gw, "a", SHORT_A), _run(gw, "b", SHORT_B))
            assert (out_a, out_b) == (reference["a"], reference["b"])
            assert {rec_a.prefill_worker, rec_b.prefill_worker} == {"pd-p0", "pd-p1"}
            # 250 tokens > threshold, but 150 are cached on one PD-P node: 100 incremental tokens stay local,
            # on the node that holds them
            out, rec, _ = await _run(gw, "b+", SHORT_B + MORE)
            assert out == reference["b+"]
            assert (rec.route, rec.prefill_worker, rec.cached_tokens) == ("local", rec_b.prefill_worker, 150)
            assert gw.router.reasons["short_after_cache"] == 1

            # a prefill node that restarts comes back empty, and the gateway forgets its entries
            gw.workers[rec_b.prefill_worker].kill()
            async with asyncio.timeout(120):
                while gw.prefixes.node_hits(SHORT_B + MORE).get(rec_b.prefill_worker, 0):
                    await asyncio.sleep(0.1)

    asyncio.run(scenario())
