"""With one worker per role, a request that finds no worker to serve it waits for one to come back.

A real gateway (one PD-P, one PrfaaS and one PD-D worker process, the link emulator). Within the
request's first-token deadline it does not fail when:
- every prefill worker it could go to is dead: it waits for their restart, then completes;
- its only decode worker hangs mid-stream past the heartbeat deadline: the request migrates back to
  that same worker once it is continued and re-attached, with no stale row of the old session left
  to refuse it, and its greedy output is transformers' own.
Past the deadline it fails with a clean ``timeout``.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from dataclasses import replace

import pytest
from conftest import served
from test_supervision import CONFIG as SUPERVISED

from minifaas.config import ClusterConfig
from minifaas.gateway.api_errors import api_error
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

CONFIG = replace(SUPERVISED, pd=ClusterConfig(prefill_workers=1, decode_workers=1), first_token_timeout=30.0)
PROMPT = [(5 * i + 1) % 256 for i in range(60)]
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return reference_tokens(ModelRuntime.load(CONFIG.model), PROMPT, PARAMS)


@pytest.fixture(scope="module")
def gateway(loop: asyncio.AbstractEventLoop, reference: list[int]) -> Iterator[Gateway]:
    yield from served(loop, CONFIG)  # type: ignore[misc]


async def all_serving(gw: Gateway) -> None:
    async with asyncio.timeout(120):
        while not all(w.serving for w in gw.pool.workers.values()):
            await asyncio.sleep(0.05)


async def stream(gw: Gateway, rid: str, fault: object = None) -> tuple[list[int], RequestRecord]:
    """The request's tokens; after its third, ``fault(decode worker)``."""
    record, tokens = RequestRecord(rid, len(PROMPT)), []
    async for event in gw.stream(GenerateRequest(rid, PROMPT, PARAMS), record):
        tokens.append(event.token_id)
        if len(tokens) == 3 and fault is not None:
            fault(gw.pool.workers[record.decode_worker])  # type: ignore[index,operator]
    return tokens, record


def test_with_every_prefill_worker_dead_a_request_waits_for_a_restart_and_completes(
    gateway: Gateway, loop: asyncio.AbstractEventLoop, reference: list[int]
) -> None:
    async def scenario() -> tuple[list[int], RequestRecord]:
        await all_serving(gateway)
        for name in ("pd-p0", "prfaas-p0"):
            gateway.pool.workers[name].kill()
        async with asyncio.timeout(30):
            while any(gateway.pool.workers[n].serving for n in ("pd-p0", "prfaas-p0")):
                await asyncio.sleep(0.01)
        return await stream(gateway, "no-prefill-worker")  # sent while none serves

    tokens, record = loop.run_until_complete(scenario())
    assert tokens == reference, record.to_json()


def test_the_only_decode_worker_hung_mid_stream_takes_its_request_back_when_continued(
    gateway: Gateway, loop: asyncio.AbstractEventLoop, reference: list[int]
) -> None:
    stopped: list[int] = []

    async def cont_later(pid: int) -> None:
        await asyncio.sleep(CONFIG.heartbeat_deadline_s + 1.5)  # past the deadline: its session is lost
        os.kill(pid, signal.SIGCONT)

    async def scenario() -> tuple[list[int], RequestRecord]:
        await all_serving(gateway)
        async with asyncio.TaskGroup() as tasks:

            def stop(w: object) -> None:
                stopped.append(w.pid)  # type: ignore[attr-defined]
                os.kill(w.pid, signal.SIGSTOP)  # type: ignore[attr-defined]
                tasks.create_task(cont_later(w.pid))  # type: ignore[attr-defined]

            done = await stream(gateway, "decode-hung", stop)
        return done

    try:
        tokens, record = loop.run_until_complete(scenario())
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert tokens == reference and record.migrations == 1, record.to_json()
    assert gateway.pool.workers["pd-d0"].pid == stopped[0]  # the same process, back in routing


def test_past_the_first_token_deadline_a_request_with_no_worker_fails_as_a_timeout(
    gateway: Gateway, loop: asyncio.AbstractEventLoop
) -> None:
    async def scenario() -> Exception:
        await all_serving(gateway)
        gateway.serving.config = replace(CONFIG, first_token_timeout=1.0)  # read per request
        decode = gateway.pool.workers["pd-d0"]
        os.kill(decode.pid, signal.SIGSTOP)
        try:
            async with asyncio.timeout(30):
                while decode.serving:  # out of routing: no decode worker for the request
                    await asyncio.sleep(0.01)
            try:
                await stream(gateway, "too-late")
            except Exception as e:
                return e
            raise AssertionError("a request with no decode worker completed")
        finally:
            os.kill(decode.pid, signal.SIGCONT)
            gateway.serving.config = CONFIG

    error = api_error(loop.run_until_complete(scenario()))
    assert (error.status, error.code) == (504, "timeout"), error
