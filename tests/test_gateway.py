"""The gateway with real worker processes, a real link emulator and real sockets."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest

from minifaas.config import CacheConfig, InterClusterLinkConfig, ServeConfig
from minifaas.control.worker_ops import Load
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, Phase, RequestRecord
from minifaas.gateway.worker_handle import WorkerError
from minifaas.launch import forked
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

pytestmark = pytest.mark.slow  # gateways started, faulted and stopped

THRESHOLD = 200
SHORT = [(7 * i) % 256 for i in range(40)]
LONG = [(13 * i + 5) % 256 for i in range(1500)]
FRESH = [(17 * i + 3) % 256 for i in range(1500)]  # shares no prefix with LONG, so no cache makes it short
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    rt = ModelRuntime.load("kimi-linear-tiny")
    prompts = {"short": SHORT, "long": LONG, "fresh": FRESH}
    out = {name: reference_tokens(rt, ids, PARAMS) for name, ids in prompts.items()}
    out["long_bytes"] = [rt.prefill(LONG).state.nbytes]  # computed here: not on the gateway's event loop
    return out


async def _run(gw: Gateway, rid: str, ids: list[int]) -> tuple[list[int], RequestRecord]:
    record = RequestRecord(rid, len(ids))
    tokens = [e.token_id async for e in gw.stream(GenerateRequest(rid, ids, PARAMS), record)]
    return tokens, record


def _children() -> set[int]:
    """Every process below this one but the shared pre-loaded parents, which stay for the next gateway."""
    found, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                below = {int(p) for p in f.read().split()}
        except FileNotFoundError:  # it has just exited
            continue
        found |= below
        todo += below
    with forked._shared_lock:  # the parents ``acquire`` keeps for the next gateway, now running
        shared = {forks.parent.pid for forks in forked._shared.values() if forks.parent and forks.running}
    return found - shared


def test_routes_outputs_fallbacks_and_clean_shutdown(reference: dict[str, list[int]]) -> None:
    # no prefix cache: the fault scenarios below need every long prompt to be prefilled and sent in full
    config = ServeConfig(
        model="kimi-linear-tiny",
        threshold=THRESHOLD,
        link=InterClusterLinkConfig(rate="20mbit", delay_ms=2.0),
        cache=CacheConfig(mode="none"),
    )
    before = _children()

    async def scenario() -> None:
        async with Gateway(config) as gw:
            # a burst of short prompts, the link idle: once PD-P is over spill_tokens (512) behind, the rest
            # spill to PrfaaS; every output is the reference
            burst = await asyncio.gather(*(_run(gw, f"burst{i}", SHORT) for i in range(24)))
            reasons = [rec.route_reason for _, rec in burst]
            assert 0 < reasons.count("short_but_pd_busy") < 24 and "short" in reasons, reasons
            assert all(rec.route == ("prfaas" if rec.route_reason == "short_but_pd_busy" else "local")
                       for _, rec in burst)  # fmt: skip
            assert all(tokens == reference["short"] for tokens, _ in burst)

            # a short prompt stays local, a long one goes PrfaaS; both equal transformers' own generate()
            short, rec_s = await _run(gw, "short", SHORT)
            long, rec_l = await _run(gw, "long", LONG)
            assert (rec_s.route, rec_l.route) == ("local", "prfaas")
            assert short == reference["short"] and long == reference["long"]
            assert rec_s.phase is Phase.FINISHED and rec_l.phase is Phase.FINISHED
            assert rec_l.kv_bytes == reference["long_bytes"][0]

            # concurrent mixed requests all complete correctly
            ids = [LONG if i % 4 == 0 else SHORT for i in range(12)]
            results = await asyncio.gather(*(_run(gw, f"mix{i}", p) for i, p in enumerate(ids)))
            for p, (tokens, _) in zip(ids, results):
                assert tokens == reference["long" if p is LONG else "short"]

            # the PrfaaS worker dies during a long prefill: the request completes through PD-P
            task = asyncio.create_task(_run(gw, "killed", LONG))
            await asyncio.sleep(0.5)
            gw.pool.workers["prfaas-p0"].kill()
            tokens, rec = await task
            assert tokens == reference["long"] and rec.route == "local" and rec.fallback
            await _wait_alive(gw, "prfaas-p0")

            # the first token goes to the client when the prefill ends, while the state still crosses the
            # link; the link is cut then: the request is redone on PD-P with that token as part of its
            # prompt, and the client's output is unchanged
            link = gw.link.control
            await link.set_rate(1e6)  # the state's tail takes seconds at this rate
            rec = RequestRecord("cut", len(LONG))
            events = gw.stream(GenerateRequest("cut", LONG, PARAMS), rec)
            first = await anext(events)
            assert rec.phase is Phase.PREFILLING and rec.ttft_s is not None, rec.to_json()  # no reply yet
            await link.cut()
            async with asyncio.timeout(60):
                while rec.route != "local":  # the retry on PD-P has begun
                    await asyncio.sleep(0.01)
            assert gw.serving.dispatch.link_bytes == 0  # the cut attempt's state is off the link's count
            tokens = [first.token_id] + [e.token_id async for e in events]
            assert tokens == reference["long"], rec.to_json()
            assert rec.route == "local" and rec.fallback == "transfer_failed", rec.to_json()
            assert any("redone" in e for e in rec.events), rec.to_json()
            await link.set_rate(20e6)
            assert gw.health()["healthy"]
            tokens, rec = await _run(gw, "after", FRESH)
            assert tokens == reference["fresh"] and rec.route == "prfaas", rec.to_json()

            # the client leaves during a long prefill: the prefill stops early, nothing is left queued,
            # and the worker serves the next request as before
            await _leave_mid_prefill(gw)
            await _leave_after_first_token(gw)
            await _stop_string_in_the_first_token(gw, reference)
            tokens, rec = await _run(gw, "after-leave", FRESH)
            assert tokens == reference["fresh"] and rec.route == "prfaas", rec.to_json()

    asyncio.run(scenario())
    assert _children() <= before, "worker or emulator processes outlived the gateway"


async def _leave_mid_prefill(gw: Gateway) -> None:
    worker, link = gw.pool.workers["prfaas-p0"], gw.link.control
    prompt = [(11 * i + 1) % 256 for i in range(3000)]  # 6 chunks of 512 tokens: seconds of prefill here
    sample = gw.metrics.registry.get_sample_value
    stopped_before = sample("minifaas:prefills_stopped_total", {"cluster": "prfaas"}) or 0.0
    sent_before = (await link.stats())["up_bytes"]
    task = asyncio.create_task(_run(gw, "leaves", prompt))
    async with asyncio.timeout(120):
        while (await link.stats())["up_bytes"] < sent_before + (64 << 10):  # KV of its first chunk, not handshakes
            await asyncio.sleep(0.05)
    task.cancel()  # what the HTTP layer does when the client goes away
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(60):
        while (sample("minifaas:prefills_stopped_total", {"cluster": "prfaas"}) or 0.0) == stopped_before:
            await asyncio.sleep(0.05)
    spared = sample("minifaas:prefill_tokens_spared_total", {"cluster": "prfaas"})
    assert spared is not None and 0 < spared < len(prompt)
    inbox = worker.open("load?")
    worker.send(Load(req="load?"))
    async with asyncio.timeout(30):
        reply = await inbox.get()
    worker.close("load?")
    assert reply.load == 0, "the stopped prompt still counts as queued"
    assert worker.busy == 0 and worker.load_tokens == 0


async def _leave_after_first_token(gw: Gateway) -> None:
    """The client leaves once its first token is shown, while the state's tail still crosses a slow link: the
    prefill worker is told to stop, and says so."""
    link, sample = gw.link.control, gw.metrics.registry.get_sample_value
    stopped_before = sample("minifaas:prefills_stopped_total", {"cluster": "prfaas"}) or 0.0
    await link.set_rate(1e6)  # the state's tail takes seconds at this rate
    prompt = [(13 * i + 5) % 256 for i in range(1500)]  # shares no prefix with the prompts before it
    record = RequestRecord("leaves-late", len(prompt))
    events = gw.stream(GenerateRequest("leaves-late", prompt, PARAMS), record)
    await anext(events)
    assert record.route == "prfaas" and record.phase is Phase.PREFILLING, record.to_json()  # the tail crossing
    await events.aclose()  # what the HTTP layer does when the client goes away
    async with asyncio.timeout(60):
        while (sample("minifaas:prefills_stopped_total", {"cluster": "prfaas"}) or 0.0) == stopped_before:
            await asyncio.sleep(0.05)
    await link.set_rate(20e6)


async def _stop_string_in_the_first_token(gw: Gateway, reference: dict[str, list[int]]) -> None:
    """The first token, shown while the state's tail still crosses a slow link, holds a stop string: the request
    ends there, finished, with no decode step, and the prefill worker is told to stop."""
    link, sample = gw.link.control, gw.metrics.registry.get_sample_value
    stopped_before = sample("minifaas:prefills_stopped_total", {"cluster": "prfaas"}) or 0.0
    first = gw.tokenizer.decode(reference["fresh"][:1])
    assert first.isascii() and first.isprintable(), first  # its own text, so the stop string can match it
    await link.set_rate(1e6)  # the state's tail takes seconds at this rate
    record = RequestRecord("stops-early", len(FRESH))
    params = replace(PARAMS, stop=(first,))
    events = [e async for e in gw.stream(GenerateRequest("stops-early", FRESH, params), record)]
    assert [(e.token_id, e.text, e.finish_reason) for e in events] == [(reference["fresh"][0], "", "stop")]
    assert record.route == "prfaas" and record.phase is Phase.FINISHED, record.to_json()
    async with asyncio.timeout(60):
        while (sample("minifaas:prefills_stopped_total", {"cluster": "prfaas"}) or 0.0) == stopped_before:
            await asyncio.sleep(0.05)
    await link.set_rate(20e6)


async def _wait_alive(gw: Gateway, name: str) -> None:
    async with asyncio.timeout(120):
        while not gw.pool.workers[name].alive:
            await asyncio.sleep(0.2)


def test_a_worker_that_cannot_start_is_named_and_nothing_is_left_running() -> None:
    before = _children()

    async def scenario() -> None:
        gw = Gateway(ServeConfig())
        planned = gw.pool.planned
        planned[:] = [replace(s, argv=(*s.argv, "--no-such-flag")) if s.name == "pd-d0" else s for s in planned]
        with pytest.raises(WorkerError, match="worker pd-d0 did not start"):
            async with gw:
                pass
        assert gw.link.emulator is None  # it starts with the first decode worker, which never came up

    asyncio.run(scenario())
    assert _children() <= before, "a worker outlived the failed start"


def test_long_prompts_past_what_the_link_carries_in_time_are_prefilled_locally(reference: dict[str, list[int]]) -> None:
    """Four long prompts at once, the link's bound one and a half transfers: two cross it, two stay on PD-P."""
    one_s = 8 * reference["long_bytes"][0] / 20e6  # one transfer's seconds at 20 Mbit/s
    config = ServeConfig(
        model="kimi-linear-tiny", threshold=THRESHOLD, link=InterClusterLinkConfig(rate="20mbit"),
        cache=CacheConfig(mode="none"), fixed_threshold=True, max_link_backlog_s=1.5 * one_s,
    )  # fmt: skip

    async def scenario() -> None:
        async with Gateway(config) as gw:
            burst = await asyncio.gather(*(_run(gw, f"long{i}", LONG) for i in range(4)))
            routes = sorted((rec.route_reason, rec.route) for _, rec in burst)
            assert routes == [("long", "prfaas")] * 2 + [("long_but_link_full", "local")] * 2, routes
            assert not any(rec.fallback for _, rec in burst) and all(t == reference["long"] for t, _ in burst)
            assert gw.serving.dispatch.link_bytes == 0  # each transfer's state counted off as it was answered
            tokens, rec = await _run(gw, "after", LONG)  # the link has caught up
            assert (tokens, rec.route_reason) == (reference["long"], "long")

    asyncio.run(scenario())


def test_the_links_backlog_counts_what_a_transfer_puts_on_the_wire(reference: dict[str, list[int]]) -> None:
    """With a codec that shrinks the state, a long prompt in flight counts on the link at its state over the
    codec's ratio so far, not at its state."""
    config = ServeConfig(
        model="kimi-linear-tiny", threshold=THRESHOLD, cache=CacheConfig(mode="none"), fixed_threshold=True,
        link=InterClusterLinkConfig(rate="2mbit", kv_compression="lossless"),
    )  # fmt: skip

    async def scenario() -> None:
        async with Gateway(config) as gw:
            dispatch, state = gw.serving.dispatch, reference["long_bytes"][0]
            ratio = gw.scheduler.compression.estimates["lossless"].ratio  # the workers' start-up calibration
            assert ratio > 1.05, ratio
            task = asyncio.create_task(_run(gw, "coded", LONG))
            async with asyncio.timeout(60):
                while not dispatch.link_bytes:
                    await asyncio.sleep(0.01)
            assert dispatch.link_bytes == round(state / ratio)
            assert dispatch.link_backlog_s() == pytest.approx(8 * state / ratio / 2e6)
            tokens, rec = await task
            assert (tokens, rec.route, rec.kv_codec) == (reference["long"], "prfaas", "lossless"), rec.to_json()
            assert dispatch.link_bytes == 0

    asyncio.run(scenario())


def test_the_gateway_sizes_a_transfer_in_the_dtype_its_workers_run() -> None:
    """The default checkpoint's config names bfloat16; on the CPU its workers run float32, and send that."""
    config = ServeConfig()
    state = ModelRuntime.load(config.model).prefill([7] * 300).state
    assert Gateway(config).kv_profile.bytes_at(300) == state.nbytes
