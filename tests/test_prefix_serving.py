"""Prefix caching in the running system: real worker processes, the gateway's directory, cache-aware routing,
incremental transfer to a decode node that holds the prefix, a cache moved across the link, and the same prompt
hitting whole on its second send."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minifaas.commands.serve import running_server
from minifaas.config import CacheConfig, ClusterConfig, InterClusterLinkConfig, ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.model.layer_state import StateKind
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.policy.router import Rule

pytestmark = pytest.mark.slow  # a gateway replaying conversations

THRESHOLD = 200
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
HTTP_PARAMS = SamplingParams(max_tokens=6)  # what the OpenAI request below asks for
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
    prompts = {"long": LONG, "a": SHORT_A, "b": SHORT_B, "b+": SHORT_B + MORE, "long+": LONG + MORE[:50]}
    reference = {name: reference_tokens(rt, ids, PARAMS) for name, ids in prompts.items()}
    long_state = rt.prefill(LONG).state
    long_text = rt.tokenizer.decode(reference_tokens(rt, LONG, HTTP_PARAMS))
    kv_per_token = sum(s.nbytes for s in long_state.layers if s.kind is StateKind.FULL_ATTENTION) // len(LONG)
    config = ServeConfig(
        model="kimi-linear-tiny",
        port=0,
        threshold=THRESHOLD,
        fixed_threshold=True,  # the scheduler leaves t and the rule where the test puts them
        pd=ClusterConfig(prefill_workers=2, decode_workers=1),
        link=InterClusterLinkConfig(rate="50mbit", delay_ms=2.0),
        cache=CacheConfig(block_size=32, snapshot_policy="interval", snapshot_interval_blocks=4),
    )

    async def scenario() -> None:
        async with running_server(config) as (gw, port):
            # the same long prompt twice through the OpenAI API: the second reports its cached tokens
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300)
            replies = []
            for _ in range(2):
                r = await client.completions.create(model="kimi-linear-tiny", prompt=LONG, max_tokens=6, temperature=0)
                replies.append(r)
            await client.close()
            first, second = (r.model_extra["minifaas"] for r in replies)
            print(f"same {len(LONG)}-token prompt twice: TTFT {first['ttft_s']:.3f} s, then {second['ttft_s']:.3f} s")
            assert [r.choices[0].text for r in replies] == [long_text, long_text]
            # the whole prompt, from the end snapshot and its logits on the node that computed it
            assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, len(LONG)]
            assert (first["route"], second["route"], second["prefill_worker"]) == ("prfaas", "prfaas", "prfaas-p0")
            # the decode node kept the first state's KV: only the tokens after its last whole block cross the link
            assert first["kv_bytes"] == long_state.nbytes
            assert second["kv_bytes"] == long_state.nbytes - 1472 * kv_per_token
            warm, rec, _ = await _run(gw, "long3", LONG)
            assert (warm, rec.cached_tokens) == (reference["long"], len(LONG))

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

            # bandwidth abundant: the longer cache counts wherever it is. 50 new tokens after the long prompt
            # cached on PrfaaS: its state crosses the link to a PD-P node, which prefills only the 50 tokens
            gw.scheduler.rule = Rule.ABUNDANT
            out, rec, _ = await _run(gw, "long+", LONG + MORE[:50])
            assert out == reference["long+"] and gw.router.reasons["short_after_cache_move"] == 1
            assert (rec.route, rec.cached_tokens) == ("local", len(LONG))
            assert gw.dispatch.moves.counts["done"] == 1 and gw.dispatch.moves.counts["bytes"] == long_state.nbytes
            gw.scheduler.rule = Rule.SCARCE

            # a prefill node that restarts comes back empty, and the gateway forgets its entries
            gw.pool.workers[rec_b.prefill_worker].kill()
            async with asyncio.timeout(120):
                while gw.prefixes.node_hits(SHORT_B + MORE).get(rec_b.prefill_worker, 0):
                    await asyncio.sleep(0.1)

    asyncio.run(scenario())


def test_the_same_prompt_hits_on_its_second_send_with_the_output_of_a_miss() -> None:
    """The default snapshot policy (reuse) keeps a prompt's state only at its end; the same prompt again loads
    it whole, on either route, and its greedy tokens are the miss's. /metrics counts each link's state bytes
    and, by codec, the bytes on the wire, as the requests' records do."""
    rt = ModelRuntime.load("kimi-linear-tiny")
    config = ServeConfig(model="kimi-linear-tiny", port=0, threshold=THRESHOLD, fixed_threshold=True)
    assert config.cache.snapshot_policy == "reuse"
    expected = {route: reference_tokens(rt, prompt, PARAMS) for prompt, route in ((LONG, "prfaas"), (SHORT_A, "local"))}

    async def scenario() -> None:  # the references are computed first: not on the gateway's event loop
        async with running_server(config) as (gw, port):
            records: dict[str, list[RequestRecord]] = {}
            for prompt, route in ((LONG, "prfaas"), (SHORT_A, "local")):
                (miss, miss_record, _), (hit, hit_record, _) = [await _run(gw, f"{route}-{i}", prompt) for i in (0, 1)]
                assert (miss_record.cached_tokens, hit_record.cached_tokens) == (0, len(prompt))
                assert miss == hit == expected[route]
                assert miss_record.route == hit_record.route == route
                records[route] = [miss_record, hit_record]
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
        kv = [s for family in text_string_to_metric_families(text) for s in family.samples if "kv_" in s.name]
        for route, link in (("prfaas", "prfaas->pd-d0"), ("local", "pd->pd-d0")):
            state = [s.value for s in kv if s.name == "minifaas:kv_bytes_sent_total" and s.labels["link"] == link]
            wire = {s.labels["codec"]: s.value for s in kv if s.name == "minifaas:kv_wire_bytes_sent_total"
                    and s.labels["link"] == link}  # fmt: skip
            assert state == [sum(r.kv_bytes for r in records[route])]
            assert sum(wire.values()) == sum(r.kv_wire_bytes for r in records[route]) > 0
            assert set(wire) == {r.kv_codec for r in records[route]}

    asyncio.run(scenario())
