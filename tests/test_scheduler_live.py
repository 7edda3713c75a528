"""The scheduler in the live gateway: real workers, a real link emulator whose bandwidth drops mid-run."""

from __future__ import annotations

import asyncio
import time

import pytest

from minifaas.config import CacheConfig, InterClusterLinkConfig, ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, Phase, RequestRecord
from minifaas.model.sampling import SamplingParams
from minifaas.policy.short_term import Action, ThresholdReason

pytestmark = pytest.mark.slow  # the live scheduler through link drops on a running gateway

THRESHOLD = 200
PROMPT_TOKENS = 240  # offloaded at t = 200; local once t has made one raise (200 -> 264)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
DROPPED_BPS = 400_000.0  # 0.4 Mbit/s: one 240-token state (~290 KB) takes about 6 s


async def _run(gw: Gateway, rid: str, seed: int) -> tuple[float, RequestRecord, int]:
    prompt = [(seed * 31 + 7 * i) % 256 for i in range(PROMPT_TOKENS)]
    record = RequestRecord(rid, len(prompt))
    started = time.monotonic()
    tokens = [e.token_id async for e in gw.stream(GenerateRequest(rid, prompt, PARAMS), record)]
    return started, record, len(tokens)


async def _client(gw: Gateway, name: str, stop: asyncio.Event, out: list) -> None:
    i = 0
    while not stop.is_set():
        out.append(await _run(gw, f"{name}-{i}", hash((name, i)) & 0xFFFF))
        i += 1


def test_a_bandwidth_drop_raises_the_threshold_loses_nothing_and_egress_fits_the_new_ceiling() -> None:
    config = ServeConfig(
        threshold=THRESHOLD, link=InterClusterLinkConfig(rate="20mbit", delay_ms=2.0), cache=CacheConfig(mode="none")
    )

    async def scenario() -> None:
        async with Gateway(config) as gw:
            done: list[tuple[float, RequestRecord, int]] = []
            first = await _run(gw, "warm", 1)  # at full rate: offloaded, and t stays put
            assert first[1].route == "prfaas" and gw.scheduler.threshold == THRESHOLD
            done.append(first)

            stop = asyncio.Event()
            async with asyncio.TaskGroup() as clients:
                for name in ("a", "b"):
                    clients.create_task(_client(gw, name, stop, done))
                await gw.link.control.set_rate(DROPPED_BPS)
                async with asyncio.timeout(150):  # a deadline for the scenario, not an assertion on timing
                    while gw.scheduler.threshold == THRESHOLD:
                        await asyncio.sleep(0.25)
                raised_at = time.monotonic()
                count = len(done)
                async with asyncio.timeout(150):
                    while len(done) < count + 6:  # six more requests under the new threshold
                        await asyncio.sleep(0.25)
                stop.set()
            ended = time.monotonic()

            assert gw.scheduler.short.reasons[ThresholdReason.LINK_SATURATED] >= 1
            # nothing lost: every request finished with all its tokens, whatever route it took
            for _, record, n in done:
                assert record.phase is Phase.FINISHED and n == PARAMS.max_tokens, record.to_json()
            # after the raise nothing new crosses the link: PrfaaS egress offered from then on fits the ceiling.
            # With the link idle the policy later probes t back down (headroom); the window ends there.
            lowered = [d.at_s for d in gw.scheduler.short.history if d.action is Action.LOWER and d.at_s > raised_at]
            until = min(lowered, default=ended)
            late = [r for started, r, _ in done if raised_at <= started < until]
            assert late and all(r.route == "local" for r in late), [r.to_json() for r in late]
            offered = sum(r.kv_bytes for started, r, _ in done if raised_at <= started < until and r.route == "prfaas")
            assert 8 * offered / (until - raised_at) <= DROPPED_BPS
            # the clients' first requests were offloaded and crossed the dropped link: they saturated it
            crossed = [r for started, r, _ in done if r.request_id[0] in "ab" and r.route == "prfaas"]
            assert crossed and all(started < raised_at for started, r, _ in done if r in crossed)
            scraped = gw.metrics.exposition().decode()
            assert 'minifaas:scheduler_decisions_total{action="raise",policy="short_term",reason="link_saturated"}' in (
                scraped
            )
            assert f"minifaas:offload_threshold_tokens {float(gw.scheduler.threshold)}" in scraped

    asyncio.run(scenario())


def test_the_fixed_threshold_switch_keeps_t_through_a_drop() -> None:
    config = ServeConfig(
        threshold=THRESHOLD,
        fixed_threshold=True,
        link=InterClusterLinkConfig(rate="20mbit", delay_ms=2.0),
        cache=CacheConfig(mode="none"),
    )

    async def scenario() -> None:
        async with Gateway(config) as gw:
            await gw.link.control.set_rate(DROPPED_BPS)
            results = await asyncio.gather(*(_run(gw, f"f{i}", i) for i in range(2)))
            ticks = gw.scheduler.short.reasons[ThresholdReason.FIXED]
            assert ticks >= 1, "the scheduler never ticked"
            assert gw.scheduler.threshold == THRESHOLD and set(gw.scheduler.short.reasons) == {ThresholdReason.FIXED}
            assert all(r.route == "prfaas" and r.phase is Phase.FINISHED for _, r, _ in results)

    asyncio.run(scenario())
