"""A request that crashes every decode worker it reaches is stopped after two, and the streams beside it finish.

A real gateway (PD-P, PrfaaS, two PD-D worker processes started as fresh interpreters, the link emulator) whose
decode workers carry the test's poison: a request whose context is in a window ends the worker as it joins the
batch (``decode_service.CRASH_AT_CONTEXT``). Four streams decode while the poison request arrives: it takes
both decode workers down one after the other and fails with ``PoisonRequest``; the four migrate, wait for a
restarted worker within their deadlines, and each equals transformers' own greedy generate().
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import replace

import pytest
from conftest import served
from test_migration import every_worker_up
from test_supervision import CONFIG as SUPERVISED

from minifaas.gateway.gateway import Gateway
from minifaas.gateway.migration import PoisonRequest
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.worker.decode_service import CRASH_AT_CONTEXT

CONFIG = replace(SUPERVISED, fork_workers=False, first_token_timeout=120.0)  # fresh workers see the poison
POISON = [(17 * i + 9) % 256 for i in range(120)]  # its context at every join: 120 or a few tokens more
STREAMS = {f"s{n}": [(11 * i + 3 * n + 1) % 256 for i in range(40)] for n in range(4)}  # contexts under 100
PARAMS = SamplingParams(max_tokens=60, ignore_eos=True)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def gateway(loop: asyncio.AbstractEventLoop) -> Iterator[Gateway]:
    os.environ[CRASH_AT_CONTEXT] = "120:140"
    try:
        yield from served(loop, CONFIG)  # type: ignore[misc]
    finally:
        del os.environ[CRASH_AT_CONTEXT]


def test_a_poison_request_is_stopped_after_two_decode_workers_and_the_others_finish_exactly(
    gateway: Gateway, loop: asyncio.AbstractEventLoop
) -> None:
    rt = ModelRuntime.load(CONFIG.model)
    expected = {rid: reference_tokens(rt, ids, PARAMS) for rid, ids in STREAMS.items()}
    got: dict[str, list[int]] = {rid: [] for rid in STREAMS}
    records = {rid: RequestRecord(rid, len(ids)) for rid, ids in STREAMS.items()}

    async def stream(rid: str) -> None:
        async for event in gateway.stream(GenerateRequest(rid, STREAMS[rid], PARAMS), records[rid]):
            got[rid].append(event.token_id)

    async def poison() -> PoisonRequest:
        while min(len(tokens) for tokens in got.values()) < 3:  # every stream is decoding
            await asyncio.sleep(0.05)
        record = RequestRecord("poison", len(POISON))
        with pytest.raises(PoisonRequest) as stopped:
            async for _ in gateway.stream(GenerateRequest("poison", POISON, SamplingParams(max_tokens=10)), record):
                pass
        return stopped.value

    async def scenario() -> PoisonRequest:
        await every_worker_up(gateway)
        async with asyncio.TaskGroup() as tasks:
            for rid in STREAMS:
                tasks.create_task(stream(rid))
            stopped = tasks.create_task(poison())
        return stopped.result()

    stopped = loop.run_until_complete(asyncio.wait_for(scenario(), 300))
    assert "decode workers pd-d0, pd-d1 each died" in str(stopped) or "pd-d1, pd-d0 each died" in str(stopped)
    assert got == expected, {rid: r.to_json() for rid, r in records.items()}
    assert any(r.migrations for r in records.values())  # streams beside it lost their worker and moved on
    text = gateway.metrics.exposition().decode()
    assert 'minifaas:migrations_total{outcome="refused"} 1.0' in text
