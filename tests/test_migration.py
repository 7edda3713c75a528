"""Decode migration: a request whose decode worker is killed or hung mid-stream moves to another one.

A real gateway (PD-P, PrfaaS, two PD-D worker processes, the link emulator): the stream goes on past
the loss with no token twice and none missing, and its greedy output equals transformers' own
generate()'s (``model.reference``); a request that loses its decode worker more often than the
migration limit fails with a retryable, counted error. The continuation itself (what the next
attempt asks for) is checked without processes.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from conftest import served
from test_supervision import CONFIG as SUPERVISED

from minifaas.gateway.api_errors import api_error
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.migration import DecodeLost, Migration, MigrationLimit, PoisonRequest, suspect
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.gateway.worker_handle import Lost
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

CONFIG = replace(SUPERVISED, migration_limit=1)  # the supervision tests' gateway: two decode workers
DEADLINE_S = CONFIG.heartbeat_deadline_s
PROMPT = [(11 * i + 3) % 256 for i in range(40)]
LONG = [(13 * i + 5) % 256 for i in range(300)]  # prefilled on PrfaaS, across the link
PARAMS = SamplingParams(max_tokens=120, ignore_eos=True)


def test_the_continuation_asks_for_the_prompt_plus_what_was_sent_and_only_the_tokens_owed() -> None:
    request = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=4))
    moving = Migration(request, limit=1)
    assert moving.request() is request
    for t in (7, 8, 9):
        moving.sent.append(t)
    again = moving.request()
    assert again.prompt_ids == [1, 2, 3, 7, 8, 9] and request.prompt_ids == [1, 2, 3]
    assert (again.sampling.max_tokens, again.sampling.min_tokens) == (7, 1)
    moving.move(DecodeLost("decode worker pd-d0 went away"))
    with pytest.raises(MigrationLimit, match=r"pd-d1 went away; the request already moved 1 time\(s\)"):
        moving.move(DecodeLost("decode worker pd-d1 went away"))
    penalised = Migration(GenerateRequest("p", [1], SamplingParams(presence_penalty=0.5)), limit=2)
    penalised.sent.append(5)
    with pytest.raises(DecodeLost, match="penalties cannot migrate"):
        penalised.move(DecodeLost("gone"))
    with pytest.raises(ValueError, match="migration limit"):
        Migration(request, limit=-1)
    error = api_error(MigrationLimit("moved too often"))
    assert (error.status, error.code) == (503, "migration_limit")


def test_without_a_limit_the_deadlines_decide_and_two_deaths_at_the_join_stop_a_poison_request() -> None:
    request = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=10))
    random_faults = Migration(request, limit=None)
    for i in range(50):  # workers lost mid-stream, however often: no count ends it
        random_faults.move(DecodeLost(f"decode worker pd-d{i % 2} went away", f"pd-d{i % 2}"))
    random_faults.move(DecodeLost("decode worker pd-d0 went away", "pd-d0", suspect=True))  # once: a fault
    assert random_faults.moves == 51
    poison = Migration(request, limit=None)
    poison.move(DecodeLost("decode worker pd-d0 went away", "pd-d0", suspect=True))
    with pytest.raises(PoisonRequest, match="decode workers pd-d0, pd-d1 each died just as they took this request"):
        poison.move(DecodeLost("decode worker pd-d1 went away", "pd-d1", suspect=True))
    error = api_error(PoisonRequest("stopped"))
    assert (error.status, error.code) == (500, "poison_request")
    with pytest.raises(MigrationLimit, match=r"migration limit \(0\)"):  # 0: never migrate
        Migration(request, limit=0).move(DecodeLost("decode worker pd-d0 went away", "pd-d0"))


def test_only_a_worker_that_ended_with_this_request_alone_unstepped_points_at_it() -> None:
    """The evidence a lost decode worker's news gives against one request (``migration.suspect``)."""
    assert suspect(Lost(silent=False, unstepped=("r",)), "r")  # it joined alone; the worker ended
    assert not suspect(Lost(silent=True, unstepped=("r",)), "r")  # stopped or hung: maybe unread
    assert not suspect(Lost(silent=False, unstepped=("q", "r")), "r")  # a restarted worker's flood
    assert not suspect(Lost(silent=False, unstepped=()), "r")  # it had been stepped
    assert not suspect(Lost(), "r")  # a loss the gateway made up (shutdown): no evidence


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    rt = ModelRuntime.load("kimi-linear-tiny")
    return {"short": reference_tokens(rt, PROMPT, PARAMS), "long": reference_tokens(rt, LONG, PARAMS)}


@pytest.fixture(scope="module")
def gateway(loop: asyncio.AbstractEventLoop, reference: dict) -> Iterator[Gateway]:
    yield from served(loop, CONFIG)  # type: ignore[misc]


async def every_worker_up(gw: Gateway) -> None:
    async with asyncio.timeout(120):
        while not all(w.alive for w in gw.pool.workers.values()):
            await asyncio.sleep(0.05)


async def stream_and_fault(
    gw: Gateway, rid: str, ids: list[int], fault: object, after: int = 3, before: list | None = None
) -> tuple[list[int], RequestRecord, list[float]]:
    """Stream the request; after ``after`` tokens apply ``fault(decode_worker)``. Returns the tokens, the
    record and each token's arrival time; ``before`` gets a copy of the record as the fault came."""
    await every_worker_up(gw)
    record = RequestRecord(rid, len(ids))
    tokens, times = [], []
    async for event in gw.stream(GenerateRequest(rid, ids, PARAMS), record):
        tokens.append(event.token_id)
        times.append(time.monotonic())
        if len(tokens) == after:
            if before is not None:
                before.append(copy.copy(record))
            fault(gw.pool.workers[record.decode_worker])  # type: ignore[index,operator]
    return tokens, record, times


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("prompt", ["short", "long"])
def test_a_decode_worker_killed_mid_stream_migrates_and_the_greedy_output_is_unchanged(
    gateway: Gateway, loop: asyncio.AbstractEventLoop, reference: dict, prompt: str
) -> None:
    ids = PROMPT if prompt == "short" else LONG
    killed: list[tuple[str, int]] = []

    def kill(w: object) -> None:
        killed.append((w.name, w.pid))  # type: ignore[attr-defined]
        w.kill()  # type: ignore[attr-defined]

    before: list[RequestRecord] = []
    coro = stream_and_fault(gateway, f"killed-{prompt}", ids, kill, before=before)
    tokens, record, times = loop.run_until_complete(asyncio.wait_for(coro, 120))
    assert tokens == reference[prompt], record.to_json()
    first = ("kv_bytes", "cached_tokens", "dispatch_s", "queue_s", "prefill_s", "transfer_s", "store_s", "control_s")
    assert [getattr(record, f) for f in first] == [getattr(before[0], f) for f in first]  # the first token's prefill
    (name, pid), pool = killed[0], gateway.pool  # SIGKILL came from outside: no evidence against a request
    assert loop.run_until_complete(pool.ended_by_itself(name, pid)) is False
    assert loop.run_until_complete(pool.ended_by_itself(name, pid + 10**6, wait=0.1)) is True  # not seen end
    assert record.migrations == 1 and record.phase.value == "finished", record.to_json()
    assert record.route == ("local" if prompt == "short" else "prfaas")  # the re-prefill is routed afresh
    stall = max(b - a for a, b in itertools.pairwise(times))
    assert stall < CONFIG.first_token_timeout
    print(f"migration after a kill ({prompt} prompt): the client's longest gap between tokens {stall * 1000:.0f} ms")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hung_decode_worker_is_declared_dead_by_its_heartbeat_and_its_request_migrates(
    gateway: Gateway, loop: asyncio.AbstractEventLoop, reference: dict
) -> None:
    stopped: list[int] = []

    def stop(w: object) -> None:
        stopped.append(w.pid)  # type: ignore[attr-defined]
        os.kill(w.pid, signal.SIGSTOP)  # type: ignore[attr-defined]

    try:
        coro = stream_and_fault(gateway, "stopped", PROMPT, stop)
        tokens, record, times = loop.run_until_complete(asyncio.wait_for(coro, 120))
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert tokens == reference["short"] and record.migrations == 1, record.to_json()
    stall = max(b - a for a, b in itertools.pairwise(times))
    assert stall < DEADLINE_S + 10  # the heartbeat deadline, then a re-prefill: not the token timeout
    print(f"migration after SIGSTOP: the client's longest gap between tokens {stall * 1000:.0f} ms")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_request_that_loses_its_decode_worker_past_the_limit_fails_clearly_and_is_counted(
    gateway: Gateway, loop: asyncio.AbstractEventLoop
) -> None:
    kills: list[str] = []

    def kill_each(w: object) -> None:
        kills.append(w.name)  # type: ignore[attr-defined]
        w.kill()  # type: ignore[attr-defined]

    async def scenario() -> None:
        await every_worker_up(gateway)
        record = RequestRecord("twice", len(PROMPT))
        count = 0
        async for _ in gateway.stream(GenerateRequest("twice", PROMPT, PARAMS), record):
            count += 1
            if count in (3, 6):  # its first decode worker, then the one it moved to
                kill_each(gateway.pool.workers[record.decode_worker])  # type: ignore[index]

    with pytest.raises(MigrationLimit, match=r"migration limit \(1\)"):
        loop.run_until_complete(asyncio.wait_for(scenario(), 120))
    assert len(set(kills)) == 2
    text = gateway.metrics.exposition().decode()
    assert 'minifaas:migrations_total{outcome="refused"} 1.0' in text
    assert 'minifaas:migrations_total{outcome="moved"}' in text
    loop.run_until_complete(every_worker_up(gateway))
