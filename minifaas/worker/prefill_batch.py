"""Short prompts prefilled together: prompts of one length, none with a cached prefix, as rows of one forward.

A prefill service's ``Batcher`` keeps its queue for the compute lock. The prompt whose turn comes leads
(``gather``), and prompts of its length queued behind it ride along, within the token budget. Each member opens
its own transfer and ``join``s; the forward starts once every member has joined or left, each row's layers
streaming to its own transfer. A member aborted meanwhile loses only its row.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Protocol, TypeVar

from minifaas.control.worker_ops import Prefill
from minifaas.model.batch_prefill import prefill_batch
from minifaas.model.decode_memory import RowBytes, row_bytes
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.transport.outgoing import KVSender
from minifaas.worker.prefix_store import CachedPrefill, Computed, LayerSink, PrefixStore

T = TypeVar("T")


class Member(Protocol):
    msg: Prefill
    plan: CachedPrefill | None
    adopted: asyncio.Future[None] | None
    batch: PrefillBatch | None
    sender: KVSender
    sink: LayerSink | None  # where its row's layers go, once its transfer is open

    @property
    def tokens(self) -> list[int]: ...

    @property
    def sampling(self) -> SamplingParams: ...


def cold(plan: CachedPrefill) -> bool:
    """A plan that is one forward from nothing: no hit, no snapshot point inside, no kept logits."""
    return plan.hit_tokens == 0 and not plan.points and plan.logits is None


async def turn_or_ride(lock: asyncio.Lock, waiting: list[Member], member: Member) -> bool:
    """Wait in ``waiting`` for ``lock`` or for a batch ahead to take ``member`` along (``member.batch``),
    whichever comes first; True if ``member`` holds the lock now (cancelled: it holds nothing, and is out)."""
    member.adopted = asyncio.get_running_loop().create_future()
    waiting.append(member)
    turn = asyncio.ensure_future(lock.acquire())
    try:
        await asyncio.wait({turn, member.adopted}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled, perhaps just as the lock came: the next prompt's turn
        _give_up(lock, turn)
        raise
    finally:
        if member in waiting:
            waiting.remove(member)
    if member.adopted.done():  # taken along, perhaps just as the lock came: the next prompt's turn
        _give_up(lock, turn)
        return False
    return True


def _give_up(lock: asyncio.Lock, turn: asyncio.Future[bool]) -> None:
    """Leave the queue for ``lock``: stop waiting, or release the lock if ``turn`` already took it."""
    if not turn.done():
        turn.cancel()
    elif not turn.cancelled() and turn.exception() is None:
        lock.release()


def gather(leader: Member, waiting: list[Member], store: PrefixStore, budget: int) -> list[Member]:
    """The prompts queued behind ``leader`` that can share its forward, each with its plan (a prompt whose plan is
    not cold stays queued, planless); none when ``leader`` cannot lead a batch."""
    n, plan = len(leader.tokens), leader.plan
    if 2 * n > budget or leader.msg.import_ is not None or plan is None or not cold(plan):
        return []
    riders: list[Member] = []
    for other in list(waiting):
        if (len(riders) + 2) * n > budget:
            break
        if len(other.tokens) == n and other.msg.import_ is None:
            other.plan = store.begin(other.tokens, time.perf_counter(), other.msg.seen_tokens or 0)
            if cold(other.plan):
                riders.append(other)
            else:
                store.release(other.plan)
                other.plan = None
    return riders


class PrefillBatch:
    def __init__(self, leader: Member, riders: list[Member], waiting: list[Member]) -> None:
        self.members = [leader, *riders]
        self.rows: list[Member] = []  # those that joined, each with its sink
        self._pending = set(range(len(self.members)))
        self._in = asyncio.Event()
        self._results: asyncio.Future[list[Computed | Exception]] = asyncio.get_running_loop().create_future()
        self._results.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, whoever waited
        for member in self.members:
            member.batch = self
        for rider in riders:
            waiting.remove(rider)
            rider.adopted.set_result(None)  # type: ignore[union-attr]

    @property
    def leader(self) -> Member:
        return self.members[0]

    def join(self, member: Member) -> None:
        """``member``'s transfer is open: its row's layers go to its sink."""
        self.rows.append(member)
        self._gone(member)

    def leave(self, member: Member) -> None:
        """``member`` will not join (aborted, or its transfer failed to open)."""
        if not self._in.is_set():
            self._gone(member)

    def _gone(self, member: Member) -> None:
        self._pending.discard(next(i for i, m in enumerate(self.members) if m is member))
        if not self._pending:
            self._in.set()

    async def run(self, runtime: ModelRuntime, store: PrefixStore) -> None:
        """Once every member has joined or left: the forward of the rows that joined, on the runtime's thread."""
        try:
            await self._in.wait()
            rows = list(self.rows)
            results = await runtime.on_forward_thread(compute_batch, runtime, store, rows)
        except BaseException as e:
            self._results.set_exception(e if isinstance(e, Exception) else RuntimeError("the batch was cancelled"))
            raise
        self._results.set_result(results)

    async def outcome(self, member: Member) -> Computed:
        """``member``'s row of the forward, or the exception that ended it."""
        results = await asyncio.shield(self._results)
        result = results[next(i for i, m in enumerate(self.rows) if m is member)]
        if isinstance(result, Exception):
            raise result
        return result


def compute_batch(runtime: ModelRuntime, store: PrefixStore, rows: list[Member]) -> list[Computed | Exception]:
    """The rows' prompts as one forward, each row's layers put in its sink. Blocking: run it in a thread."""
    sinks = [m.sink.put_layer for m in rows if m.sink is not None]
    assert len(sinks) == len(rows), "a row joined before its transfer was open"
    results = prefill_batch(runtime, [m.tokens for m in rows], sinks, [m.sampling for m in rows])
    return [r if isinstance(r, Exception) else Computed(r, cut=not store.enabled) for r in results]


class Batcher:
    """A prefill service's queue for its compute lock, and the batches made from it (``budget`` 0: none)."""

    def __init__(self, lock: asyncio.Lock, runtime: ModelRuntime, store: PrefixStore, budget: int) -> None:
        self.lock, self.runtime, self.store, self.budget = lock, runtime, store, budget
        self.waiting: list[Member] = []  # prompts queued for the lock that a batch may take along
        self.riders = 0  # prompts computed in the forward of a prompt ahead of them
        self.sizes: RowBytes | None = None  # a request's state size, once a batch needs it

    async def turn(self, member: Member) -> bool:
        """The lock in arrival order, or a ride in a batch ahead; True if ``member`` holds the lock."""
        if not self.budget:
            return await self.lock.acquire()
        return await turn_or_ride(self.lock, self.waiting, member)

    def connections(self, member: Member, most: int) -> int:
        """The connections ``member``'s transfer needs: a batched state is small, a few chunks cross at once
        (0 outside a batch: the sender's own count)."""
        if member.batch is None:
            return 0
        if self.sizes is None:
            self.sizes = row_bytes(self.runtime)
        state = self.sizes.fixed + self.sizes.per_token * len(member.tokens)
        return max(1, min(most, -(-state // member.sender.config.chunk_bytes)))  # a chunk per connection at once

    def gather(self, leader: Member) -> None:
        """``leader`` leads a batch of the prompts queued behind it that can share its forward, if any can."""
        riders = gather(leader, self.waiting, self.store, self.budget) if self.budget else []
        if riders:
            PrefillBatch(leader, riders, self.waiting)
            self.riders += len(riders)

    async def row(self, member: Member, stop: threading.Event) -> Computed:
        """``member``'s row of its batch's forward. Cancelled, the row stops at its next layer (``stop``) and the
        forward goes on for the others; the leader runs it, and returns only once it has ended."""
        batch = member.batch
        assert batch is not None
        batch.join(member)
        if batch.leader is member:
            await until_done(stop, asyncio.ensure_future(batch.run(self.runtime, self.store)))
        try:
            return await batch.outcome(member)
        except asyncio.CancelledError:
            stop.set()
            raise


async def until_done(stop: threading.Event, work: asyncio.Future[T]) -> T:
    """``work``'s result. If the awaiting task is cancelled, set ``stop`` and wait for ``work`` to end (a forward
    checks ``stop`` at its next layer) before the cancellation goes on."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        stop.set()
        while not work.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([work])
        if not work.cancelled():
            work.exception()  # retrieved (Stopped, or what the forward raised): the request is gone anyway
        raise
