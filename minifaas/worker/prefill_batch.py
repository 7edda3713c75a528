"""Short prompts prefilled together: prompts of one length, none with a cached prefix, as rows of one forward.

A prefill service's ``Batcher`` keeps its queue for the compute lock. The prompt whose turn comes leads
(``gather``), and prompts of its length queued behind it ride along in its ``PrefillBatch`` (``batch_prefill``),
within the token budget, each row's layers streaming to its own transfer. A member aborted meanwhile loses only
its row.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Protocol, TypeVar

from minifaas.control.worker_ops import Prefill
from minifaas.model.batch_prefill import Member, PrefillBatch
from minifaas.model.decode_memory import RowBytes, row_bytes
from minifaas.model.runtime import ModelRuntime
from minifaas.transport.outgoing import KVSender
from minifaas.worker.prefix_store import CachedPrefill, Computed, PrefixStore

T = TypeVar("T")


class Queued(Member, Protocol):
    """A prompt queued for the compute lock, which a batch ahead of it may take along."""

    msg: Prefill
    plan: CachedPrefill | None
    sender: KVSender


def cold(plan: CachedPrefill) -> bool:
    """A plan that is one forward from nothing: no hit, no snapshot point inside, no kept logits."""
    return plan.hit_tokens == 0 and not plan.points and plan.logits is None


async def turn_or_ride(lock: asyncio.Lock, waiting: list[Queued], member: Queued) -> bool:
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


def gather(leader: Queued, waiting: list[Queued], store: PrefixStore, budget: int) -> list[Queued]:
    """The prompts queued behind ``leader`` that can share its forward, each with its plan (a prompt whose plan is
    not cold stays queued, planless); none when ``leader`` cannot lead a batch."""
    n, plan = len(leader.tokens), leader.plan
    if 2 * n > budget or leader.msg.import_ is not None or plan is None or not cold(plan):
        return []
    riders: list[Queued] = []
    for other in list(waiting):
        if (len(riders) + 2) * n > budget:
            break
        if len(other.tokens) == n and other.msg.import_ is None:
            other.plan = store.begin(other.tokens, other.msg.seen_tokens or 0)
            if cold(other.plan):
                riders.append(other)
            else:
                store.release(other.plan)
                other.plan = None
    return riders


class Batcher:
    """A prefill service's queue for its compute lock, and the batches made from it (``budget`` 0: none)."""

    def __init__(self, lock: asyncio.Lock, runtime: ModelRuntime, store: PrefixStore, budget: int) -> None:
        self.lock, self.runtime, self.store, self.budget = lock, runtime, store, budget
        self.waiting: list[Queued] = []  # prompts queued for the lock that a batch may take along
        self.riders = 0  # prompts computed in the forward of a prompt ahead of them
        self.sizes: RowBytes | None = None  # a request's state size, once a batch needs it

    async def turn(self, member: Queued) -> bool:
        """The lock in arrival order, or a ride in a batch ahead; True if ``member`` holds the lock."""
        if not self.budget:
            return await self.lock.acquire()
        return await turn_or_ride(self.lock, self.waiting, member)

    def connections(self, member: Queued, most: int) -> int:
        """The connections ``member``'s transfer needs: a batched state is small, a few chunks cross at once
        (0 outside a batch: the sender's own count)."""
        if member.batch is None:
            return 0
        if self.sizes is None:
            self.sizes = row_bytes(self.runtime)
        state = self.sizes.fixed + self.sizes.per_token * len(member.tokens)
        return max(1, min(most, -(-state // member.sender.config.chunk_bytes)))  # a chunk per connection at once

    def gather(self, leader: Queued) -> None:
        """``leader`` leads a batch of the prompts queued behind it that can share its forward, if any can."""
        riders = gather(leader, self.waiting, self.store, self.budget) if self.budget else []
        if riders:
            PrefillBatch(leader, riders, self.waiting)
            self.riders += len(riders)

    async def row(self, member: Queued, stop: threading.Event) -> Computed:
        """``member``'s row of its batch's forward. Cancelled, the row stops at its next layer (``stop``) and the
        forward goes on for the others; the leader runs it, and returns only once it has ended."""
        batch = member.batch
        assert batch is not None
        batch.join(member)
        if batch.leader is member:
            await until_done(stop, asyncio.ensure_future(batch.run(self.runtime)))
        try:
            return Computed(await batch.outcome(member), cut=not self.store.enabled)
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
