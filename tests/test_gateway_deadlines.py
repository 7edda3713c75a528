"""Deadlines, worker deaths and refused prompts in a real gateway: worker processes, sockets, signals.

A deadline bounds silence, not length: a stream read slowly for longer than every
deadline completes, a decode worker stopped mid-stream fails its request within the
deadline between tokens. A worker killed by a signal is logged with that signal. A
prompt the model cannot take is refused by the Python API before anything runs, and one past
the admission bound at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest
from conftest import served

from minifaas.config import CacheConfig, ClusterConfig, ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import DeadlineExceeded, GenerateRequest, Overloaded, RequestRecord
from minifaas.model.sampling import SamplingParams

TOKEN_TIMEOUT = 1.5
CONFIG = ServeConfig(
    threshold=100_000,  # every prompt stays local: no PrfaaS worker is needed
    prfaas=ClusterConfig(prefill_workers=0),
    cache=CacheConfig(mode="none"),
    first_token_timeout=60.0,
    token_timeout=TOKEN_TIMEOUT,
)
PROMPT = [(3 * i + 1) % 256 for i in range(24)]
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # a gateway held past its deadlines


@pytest.fixture(scope="module")
def gateway(loop: asyncio.AbstractEventLoop) -> Iterator[Gateway]:
    yield from served(loop, CONFIG)  # type: ignore[misc]


def run(loop: asyncio.AbstractEventLoop, coro: object, seconds: float = 120) -> object:
    return loop.run_until_complete(asyncio.wait_for(coro, seconds))  # type: ignore[arg-type]


async def generate(gw: Gateway, rid: str, max_tokens: int, read_pause: float = 0.0) -> list[int]:
    request = GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens = []
    async for event in gw.stream(request, RequestRecord(rid, len(PROMPT))):
        tokens.append(event.token_id)
        await asyncio.sleep(read_pause)  # a client that reads slowly is not the server being silent
    return tokens


def test_a_stream_longer_than_every_deadline_completes(gateway: Gateway, loop: asyncio.AbstractEventLoop) -> None:
    start = time.monotonic()
    tokens = run(loop, generate(gateway, "slow-reader", 40, read_pause=0.1))
    assert len(tokens) == 40  # type: ignore[arg-type]
    assert time.monotonic() - start > 2.5 * TOKEN_TIMEOUT


@pytest.mark.parametrize("bad", ["empty", "negative", "past the vocabulary"])
def test_the_python_api_refuses_a_prompt_it_cannot_serve_before_anything_runs(
    gateway: Gateway, loop: asyncio.AbstractEventLoop, bad: str
) -> None:
    vocab = gateway.tokenizer.vocab_size
    prompt, says = {
        "empty": ([], "the prompt is empty"),
        "negative": ([5, -1, 7], "token id -1 is outside"),
        "past the vocabulary": ([5, vocab, 7], f"token id {vocab} is outside the vocabulary \\[0, {vocab}\\)"),
    }[bad]

    async def ask() -> list[int]:
        request = GenerateRequest("bad", prompt, SamplingParams(max_tokens=2))
        return [event.token_id async for event in gateway.stream(request, RequestRecord("bad", len(prompt)))]

    with pytest.raises(ValueError, match=says):
        run(loop, ask())
    assert gateway.admission.requests == 0
    assert len(run(loop, generate(gateway, "after-bad", 3))) == 3  # type: ignore[arg-type]


def test_a_request_past_the_admission_bound_is_refused_at_once_and_the_next_one_served_once_room_is_made(
    gateway: Gateway, loop: asyncio.AbstractEventLoop
) -> None:
    admission = gateway.admission

    async def full_then_free() -> tuple[Overloaded, list[int]]:
        held = []
        for i in range(2):  # two streams held open after their first token
            request = GenerateRequest(f"held-{i}", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
            held.append(gateway.stream(request, RequestRecord(f"held-{i}", len(PROMPT))))
            await anext(held[-1])
        assert gateway.admission.requests == 2 and admission.waiting == 0
        try:
            with pytest.raises(Overloaded, match="2 requests in flight") as refused:
                await generate(gateway, "refused", 3)
        finally:
            for events in held:
                await events.aclose()  # aborts both on their workers
        return refused.value, await generate(gateway, "admitted", 3)

    bound, admission.max_requests = admission.max_requests, 2
    try:
        refusal, tokens = run(loop, full_then_free())  # type: ignore[misc]
    finally:
        admission.max_requests = bound
    assert refusal.retry_after >= 1 and len(tokens) == 3 and gateway.admission.requests == 0


def test_a_decode_worker_gone_silent_fails_its_request_within_the_deadline(
    gateway: Gateway, loop: asyncio.AbstractEventLoop
) -> None:
    decode = gateway.pool.workers["pd-d0"]
    assert decode.pid

    async def stopped_mid_stream() -> float:
        request = GenerateRequest("stopped", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
        events = gateway.stream(request, RequestRecord("stopped", len(PROMPT)))
        await anext(events)
        await anext(events)
        os.kill(decode.pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            with pytest.raises(DeadlineExceeded, match=f"no token for {TOKEN_TIMEOUT:g} s"):
                async for _ in events:
                    pass
        finally:
            os.kill(decode.pid, signal.SIGCONT)
        return time.monotonic() - start

    waited = run(loop, stopped_mid_stream())
    assert waited < TOKEN_TIMEOUT + 2.0  # type: ignore[operator]
    assert len(run(loop, generate(gateway, "after", 5))) == 5  # type: ignore[arg-type]


def test_a_killed_worker_is_logged_with_its_signal(
    gateway: Gateway, loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    worker = gateway.pool.workers["pd-p0"]

    async def kill_and_wait() -> None:
        worker.kill()
        while not gateway.launcher.restarts.get("pd-p0"):  # counted once the death is logged, as the restart begins
            await asyncio.sleep(0.05)

    with caplog.at_level(logging.ERROR, logger="minifaas.gateway"):
        run(loop, kill_and_wait())
    assert "worker pd-p0 died (killed by SIGKILL): restarting it" in caplog.text
