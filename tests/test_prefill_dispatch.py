"""A prefill attempt's wait for its reply: replies meant for another attempt are handed on, not taken."""

from __future__ import annotations

import asyncio

from minifaas.cache.prefix_index import PrefixDirectory
from minifaas.control.worker_ops import Error, First, Prefilled, ReplyMessage
from minifaas.gateway.prefill_dispatch import Attempt, _outcome
from minifaas.gateway.requests import GenerateRequest
from minifaas.gateway.worker_handle import WorkerHandle
from minifaas.launch.worker_specs import WorkerSpec
from minifaas.model.sampling import SamplingParams


def handle(name: str, role: str, cluster: str) -> WorkerHandle:
    return WorkerHandle(
        WorkerSpec(name, role, cluster), name, role, cluster, PrefixDirectory(False, 16, "test", False, ())
    )


def prefilled(transfer: int) -> Prefilled:
    times = dict.fromkeys(("queue_s", "prefill_s", "transfer_tail_s", "worker_s", "kv_encode_s", "kv_decode_s"), 0.0)
    counts = {"kv_bytes": 0, "cached_tokens": 0, "computed_tokens": 3, "kv_wire_bytes": 0}
    return Prefilled(req="r0", transfer=transfer, next_token=7, codec="raw", **times, **counts)


def first(transfer: int, token: int) -> First:
    return First(req="r0", transfer=transfer, next_token=token)


def test_an_earlier_attempts_replies_go_to_unclaimed_and_the_attempts_own_reply_is_returned() -> None:
    async def main() -> None:
        worker = handle("pd-p0", "prefill", "pd")
        handed: list[ReplyMessage] = []
        worker.on_unclaimed = lambda _, msg: handed.append(msg)
        request = GenerateRequest("r0", [1, 2, 3], SamplingParams(max_tokens=4))
        attempt = Attempt(request, None, worker, handle("pd-d0", "decode", "pd"), transfer=2, computed=3, link_start=0)
        inbox = worker.open("r0")
        firsts: list[int] = []
        for msg in (first(1, 5), prefilled(1), first(2, 7), prefilled(2)):
            inbox.put_nowait(msg)
        got = await asyncio.wait_for(_outcome(inbox, attempt, firsts.append, asyncio.Event(), None), 5)
        assert got == prefilled(2)
        assert handed == [first(1, 5), prefilled(1)]  # the earlier attempt's, for whoever handles strays
        assert firsts == [7]  # only this attempt's early first token is shown

    asyncio.run(main())


def test_a_worker_that_refuses_the_request_ends_the_wait_at_once() -> None:
    """A worker answers a message it cannot take with an Error: the attempt ends there, not at its timeout."""

    async def main() -> None:
        worker = handle("pd-p0", "prefill", "pd")
        request = GenerateRequest("r0", [1, 2, 3], SamplingParams(max_tokens=4))
        attempt = Attempt(request, None, worker, handle("pd-d0", "decode", "pd"), transfer=2, computed=3, link_start=0)
        inbox = worker.open("r0")
        inbox.put_nowait(Error(req="r0", error="Expected `int` <= 2147483647 - at `$.sampling.top_k`"))
        got = await asyncio.wait_for(_outcome(inbox, attempt, None, asyncio.Event(), None), 5)
        assert isinstance(got, Error) and "top_k" in got.error

    asyncio.run(main())
