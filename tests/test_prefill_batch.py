"""Short prompts queued at once prefill as rows of one forward: each one's state and tokens as it alone gives.

A real prefill service, real sockets to a real receiver: five prompts of one length arrive together, the first
takes the compute and the other four ride in its forward; a prompt of another length, or one with a cached
prefix, runs on its own; one that is aborted mid-batch leaves the others whole and the compute free, and so
does one aborted in the very turn of the loop its wait for the compute ends in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
import torch
from conftest import decodes_as_alone

from minifaas.cache.pool_config import PoolConfig
from minifaas.control.worker_ops import Prefill, Prefilled, Sampling
from minifaas.model.layer_state import ModelState
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.model.state_layout import needs_snapshot
from minifaas.transport.receiver import KVReceiver, ReceiverConfig
from minifaas.worker.prefill_service import PrefillService, turn_or_ride
from minifaas.worker.prefix_store import PrefixStore

SECRET = b"cluster-secret-0123456789abcdef"
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def runtime() -> ModelRuntime:
    return ModelRuntime.load("shakespeare-qwen3.5")


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 240))


async def prefilled(
    service: PrefillService, prompts: list[list[int]], cancel: int | None = None
) -> list[tuple[Prefilled, ModelState] | None]:
    """Every prompt sent at once; ``cancel``: that one is aborted once the batch's forward is under way."""
    async with KVReceiver(ReceiverConfig(SECRET)) as rx:

        async def one(i: int, tokens: list[int]) -> tuple[Prefilled, ModelState]:
            msg = Prefill(req=f"r{i}", tokens=tokens, sampling=Sampling.of(PARAMS), transfer=i,
                          kv=["127.0.0.1", rx.port], link_start=0)  # fmt: skip
            reply, state = await asyncio.gather(service.prefill(msg), rx.transfer(i).model_state())
            return reply, state

        tasks = [asyncio.create_task(one(i, tokens)) for i, tokens in enumerate(prompts)]
        if cancel is not None:
            while not service.riders:
                await asyncio.sleep(0.001)
            tasks[cancel].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
    await service.close()
    assert not service.compute.locked() and service.queued_tokens == 0 and not service.waiting
    return [None if isinstance(d, BaseException) else d for d in done]


def test_prompts_of_one_length_queued_together_share_a_forward(runtime: ModelRuntime) -> None:
    prompts = [prompt(64, seed) for seed in range(5)] + [prompt(40, 9)]  # the last: another length, alone
    layout = runtime.layout.kinds
    store = PrefixStore(PoolConfig("n", 1 << 30, 16, 0, needs_snapshot(layout)), runtime.spec.name, layout, "n")
    service = PrefillService(runtime, SECRET, 2, True, store, chunk_tokens=512, batch_tokens=512)
    done = run(prefilled(service, prompts))
    assert service.riders == 4
    # a batched state is a chunk a layer: one connection each, not the sender's 2 (the lone prompt takes both)
    assert sum(sender.pool.dialled for sender in service.senders.values()) <= 5 + 2
    for tokens, result in zip(prompts, done, strict=True):
        assert result is not None
        reply, state = result
        assert reply.kv_bytes == state.nbytes and reply.cached_tokens == 0 and state.seq_len == len(tokens)
        decodes_as_alone(runtime, tokens, reply, state, PARAMS)
    again = run(prefilled(service, prompts[:2]))  # now cached: each runs alone from its hit
    assert service.riders == 4 and all(r is not None and r[0].cached_tokens > 0 for r in again)


def test_a_prompt_aborted_mid_batch_leaves_the_others_whole(runtime: ModelRuntime) -> None:
    prompts = [prompt(64, seed) for seed in range(10, 14)]
    layout = runtime.layout.kinds
    off = PoolConfig("n", 0, 16, 0, needs_snapshot(layout), enabled=False)
    store = PrefixStore(off, runtime.spec.name, layout, "n")
    service = PrefillService(runtime, SECRET, 2, True, store, chunk_tokens=512, batch_tokens=512)
    done = run(prefilled(service, prompts, cancel=2))
    assert done[2] is None and service.riders == 3
    for i in (0, 1, 3):
        result = done[i]
        assert result is not None
        decodes_as_alone(runtime, prompts[i], *result, PARAMS)


def test_a_prompt_aborted_as_its_turn_comes_leaves_the_compute_free() -> None:
    class Queued:  # what the queue reads of a prompt (a job of the prefill service)
        adopted: asyncio.Future[None] | None = None
        batch = None

    async def scenario() -> bool:
        lock, waiting = asyncio.Lock(), []
        await lock.acquire()  # another prompt computes
        queued = asyncio.create_task(turn_or_ride(lock, waiting, Queued()))  # type: ignore[arg-type]
        while not waiting:
            await asyncio.sleep(0)
        lock.release()  # its turn: the lock goes to its waiter ...
        await asyncio.sleep(0)
        assert lock.locked()  # ... which has it, and the prompt has not yet seen so
        queued.cancel()  # the abort lands in that gap (a session ending as a prefill finishes)
        with pytest.raises(asyncio.CancelledError):
            await queued
        return lock.locked()

    assert asyncio.run(scenario()) is False  # given back: the next prompt is not stuck behind it
