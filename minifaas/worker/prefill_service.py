"""A prefill worker's job: run prompts through the model and stream each layer's state as it is made.

``prefill`` waits for the prompt's turn at the compute lock (arrival order), plans it (``PrefixStore``) and
chooses, once, how it runs: alone with its cached prefix loaded, or leading the prompts of its length queued
behind it, none with a cached prefix, as rows of one forward (``PrefillBatch``; a member aborted meanwhile loses
only its row). The core is ``_run``: open the transfer, run the forwards into its ``TransferSink``, send the first
token, reply; the pool then keeps the prompt's blocks and snapshots (``_keep``). A prompt that a cache move goes
ahead of first takes the moved prefix in (``prefix_moves``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from minifaas.codec.codec import Codec, usable
from minifaas.control.worker_ops import Export, First, Prefill, Prefilled
from minifaas.model.batch_prefill import PrefillBatch
from minifaas.model.decode_memory import row_bytes
from minifaas.model.layer_state import LayerState, StateKind
from minifaas.model.runtime import ModelRuntime, PrefillResult
from minifaas.model.sampling import SamplingParams
from minifaas.transport.outgoing import KVSender, OutgoingTransfer, SenderConfig, TransferReport
from minifaas.transport.receiver import KVReceiver
from minifaas.worker.prefix_moves import take_in
from minifaas.worker.prefix_store import CachedPrefill, PrefixStore

log = logging.getLogger("minifaas.prefill")
T = TypeVar("T")


class Stopped(Exception):
    """Raised in the compute thread, from the model's layer hook, once the request was aborted."""


class PrefillService:
    def __init__(
        self,
        runtime: ModelRuntime,
        secret: bytes,
        connections: int,
        pipelined: bool,
        store: PrefixStore,
        receiver: KVReceiver | None = None,  # takes cache moves in; None: this node accepts none
        chunk_tokens: int = 0,  # prefill in forwards of at most this many tokens, streaming each (0: one forward)
        codecs: frozenset[Codec] = frozenset(),  # the codecs this worker may send with (none always)
        batch_tokens: int = 0,  # queued prompts of one length share a forward of at most this many tokens (0: not)
    ) -> None:
        # without full attention nothing can stream before the last token: chunks would only cost, and the
        # transfer would sit open with nothing on it
        self.chunk_tokens = chunk_tokens if any(kind.grows for kind in store.layout) else 0
        self.runtime, self.secret, self.store = runtime, secret, store
        self.receiver = receiver
        self.connections, self.pipelined = connections, pipelined
        self.codecs = codecs | {Codec.NONE}
        self.senders: dict[tuple[str, int], KVSender] = {}
        self.compute = asyncio.Lock()  # one prompt computes at a time; held until the pool has kept its part
        self.batch_tokens = batch_tokens  # a batch's token budget
        self.waiting: list[PrefillJob] = []  # prompts queued for the lock that a batch may take along
        self.riders = 0  # prompts computed in the forward of a prompt ahead of them
        self.sizes = row_bytes(runtime) if batch_tokens else None  # a request's state size, for a batch's rows
        self.queued: set[PrefillJob] = set()  # prompts waiting for their turn or in their forwards
        self._keeping: set[asyncio.Task[None]] = set()  # stores into the pool still under way
        self.kept: Callable[[], None] | None = None  # called after each store (the session sends the pool's news)
        self.stopped_at: dict[str, int] = {}  # aborted request -> prompt tokens its forward had handed on

    @property
    def queued_tokens(self) -> int:
        return sum(len(job.tokens) for job in self.queued)

    def sender(self, host: str, port: int) -> KVSender:
        key = (host, port)
        if key not in self.senders:
            config = SenderConfig(host, port, self.secret, connections=self.connections, pipelined=self.pipelined)
            self.senders[key] = KVSender(config)
        return self.senders[key]

    async def prefill(self, msg: Prefill, first: Callable[[First], None] | None = None) -> Prefilled:
        """Prefill ``msg.tokens``, stream the state to ``msg.kv``; the ``prefilled`` reply. ``first`` gets
        the first token (``First``) as soon as the forwards are done, ahead of the transfer's tail.
        Cancelling the task aborts the request: the forward stops early, ``stopped_at[req]`` says how far."""
        job = PrefillJob(msg, self.sender(*msg.kv), time.perf_counter())
        if msg.import_ is not None:
            await take_in(self.store, self.receiver, job.tokens, msg.import_)
        self.queued.add(job)
        try:
            job.holds_lock = await turn_or_ride(self.compute, self.waiting, job)  # False: a batch took it along
            job.started = time.perf_counter()
            if job.batch is None:  # batching is chosen once, here: alone, or leading the prompts queued behind
                job.plan = self.store.begin(job.tokens, msg.seen_tokens or 0)
                if self.batch_tokens and (riders := gather(job, self.waiting, self.store, self.batch_tokens)):
                    PrefillBatch(job, riders, self.waiting)
                    self.riders += len(riders)
            return await self._run(job, first)
        except asyncio.CancelledError:
            self.stopped_at[msg.req] = job.sink.handed_tokens if job.sink is not None else 0
            raise
        finally:  # whatever the pool's task did not take over is given back
            if job.batch is not None:
                job.batch.leave(job)
            self.queued.discard(job)
            if job.plan is not None:
                self.store.release(job.plan)
            if job.holds_lock:
                self.compute.release()

    async def _run(self, job: PrefillJob, first: Callable[[First], None] | None) -> Prefilled:
        """The core: the forwards, each layer put in the transfer's sink as it is made; the first token; the reply."""
        msg, plan = job.msg, job.plan
        assert plan is not None
        if job.batch is None and not self.chunk_tokens:  # the snapshot segments, before the transfer opens
            await until_done(job.stop, self.runtime.on_forward_thread(self.store.advance, self.runtime, plan))
        connections = self._connections(job)
        async with job.sender.stream(msg.transfer, self.runtime.num_states, 0, self.codec(msg), connections) as tx:
            job.sink = TransferSink(tx, msg.link_start, len(job.tokens), job.stop)
            if job.batch is None:
                args = (self.runtime, plan, job.sink, job.sampling, self.chunk_tokens)
                result = await until_done(job.stop, self.runtime.on_forward_thread(self.store.compute, *args))
            else:
                result = await self._row(job)
            self.queued.discard(job)  # its forwards are done: it no longer counts as queued
            computed_at = time.perf_counter()
            if first is not None:  # the client may see it while the transfer's tail is still on the wire
                first(First(req=msg.req, transfer=msg.transfer, next_token=result.next_token))
            self._keep(job, result)
        assert tx.report is not None
        return _prefilled(job, plan, result, tx.report, computed_at, time.perf_counter())

    def _connections(self, job: PrefillJob) -> int:
        """The connections a batched prompt's transfer needs: its state is small, a few chunks cross at once
        (0 outside a batch: the sender's own count)."""
        if job.batch is None or self.sizes is None:
            return 0
        state = self.sizes.fixed + self.sizes.per_token * len(job.tokens)
        return max(1, min(self.connections, -(-state // job.sender.config.chunk_bytes)))  # a chunk per connection

    async def _row(self, job: PrefillJob) -> PrefillResult:
        """``job``'s row of its batch's forward. Cancelled, the row stops at its next layer (``job.stop``) and the
        forward goes on for the others; the leader runs it, and returns only once it has ended."""
        batch = job.batch
        assert batch is not None
        batch.join(job)
        if batch.leader is job:
            await until_done(job.stop, batch.run(self.runtime))
        try:
            return await batch.outcome(job)
        except asyncio.CancelledError:
            job.stop.set()
            raise

    def _keep(self, job: PrefillJob, result: PrefillResult) -> None:
        """Copy out (on the forward thread) and store what the pool keeps of a computed prompt, then let the next
        prompt compute: it sees this one's blocks. Nobody waits on it for a first token. It takes the prompt's
        plan and compute lock over."""
        plan, holds_lock = job.plan, job.holds_lock
        assert plan is not None
        job.plan, job.holds_lock = None, False

        async def keep() -> None:
            try:
                if not plan.cut:  # nothing to copy with the cache off: no thread hop either
                    await self.runtime.on_forward_thread(self.store.cut, plan, result)
                self.store.finish(plan, result, time.perf_counter())
            except Exception:  # the prompt was answered; only its cache entries are lost
                log.exception("storing a prompt's prefix in the pool failed")
            finally:
                self.store.release(plan)
                if holds_lock:  # the next prompt's turn
                    self.compute.release()
                if self.kept is not None:
                    self.kept()

        task = asyncio.ensure_future(keep())
        self._keeping.add(task)
        task.add_done_callback(self._keeping.discard)

    def codec(self, msg: Prefill | Export) -> Codec:
        """The codec the gateway asked for, or the nearest this worker allows."""
        return usable(Codec.named(msg.codec or "none"), self.codecs)

    async def close(self) -> None:
        await asyncio.gather(*self._keeping, return_exceptions=True)
        for sender in self.senders.values():
            await sender.__aexit__(None, None, None)


@dataclass(eq=False, slots=True)
class PrefillJob:
    """A prompt on its way through the service, and what it holds: its plan and the compute lock, until the
    pool's task takes them over."""

    msg: Prefill
    sender: KVSender
    arrived: float
    started: float = 0.0  # its turn came
    stop: threading.Event = field(default_factory=threading.Event)  # set on abort: the forward stops
    holds_lock: bool = False
    plan: CachedPrefill | None = None  # its pinned hit
    sink: TransferSink | None = None  # where its forward puts its layers, and how far it got
    batch: PrefillBatch | None = None  # the batch whose forward computes it (it may lead it)
    adopted: asyncio.Future[None] | None = None  # set when a batch ahead of it takes it along

    @property
    def tokens(self) -> list[int]:
        return self.msg.tokens

    @property
    def sampling(self) -> SamplingParams:
        return self.msg.sampling.params()


def _prefilled(
    job: PrefillJob, plan: CachedPrefill, result: PrefillResult, report: TransferReport, computed_at: float, now: float
) -> Prefilled:
    """The reply: the first token, what the cache saved, where the time went, what the codec did."""
    assert job.sink is not None
    return Prefilled(
        req=job.msg.req,
        transfer=job.msg.transfer,
        next_token=result.next_token,
        kv_bytes=job.sink.nbytes,
        cached_tokens=plan.hit_tokens,
        computed_tokens=result.computed_tokens,
        queue_s=job.started - job.arrived,
        prefill_s=result.seconds,
        transfer_tail_s=now - computed_at,
        worker_s=now - job.started,
        codec=report.codec,
        kv_wire_bytes=report.wire_bytes,
        kv_encode_s=report.encode_s,
        kv_decode_s=report.decode_s,
    )


def cold(plan: CachedPrefill) -> bool:
    """A plan that is one forward from nothing: no hit, no snapshot point inside, no kept logits."""
    return plan.hit_tokens == 0 and not plan.points and plan.logits is None


def gather(leader: PrefillJob, waiting: list[PrefillJob], store: PrefixStore, budget: int) -> list[PrefillJob]:
    """The prompts queued behind ``leader`` that can share its forward, each with its plan (a prompt whose plan is
    not cold stays queued, planless); none when ``leader`` cannot lead a batch."""
    n, plan = len(leader.tokens), leader.plan
    if 2 * n > budget or leader.msg.import_ is not None or plan is None or not cold(plan):
        return []
    riders: list[PrefillJob] = []
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


async def turn_or_ride(lock: asyncio.Lock, waiting: list[PrefillJob], job: PrefillJob) -> bool:
    """Wait in ``waiting`` for ``lock`` or for a batch ahead to take ``job`` along (``job.batch``), whichever
    comes first; True if ``job`` holds the lock now (cancelled: it holds nothing, and is out)."""
    job.adopted = asyncio.get_running_loop().create_future()
    waiting.append(job)
    turn = asyncio.ensure_future(lock.acquire())
    try:
        await asyncio.wait({turn, job.adopted}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled, perhaps just as the lock came: the next prompt's turn
        _give_up(lock, turn)
        raise
    finally:
        if job in waiting:
            waiting.remove(job)
    if job.adopted.done():  # taken along, perhaps just as the lock came: the next prompt's turn
        _give_up(lock, turn)
        return False
    return True


def _give_up(lock: asyncio.Lock, turn: asyncio.Future[bool]) -> None:
    """Leave the queue for ``lock``: stop waiting, or release the lock if ``turn`` already took it."""
    if not turn.done():
        turn.cancel()
    elif not turn.cancelled() and turn.exception() is None:
        lock.release()


async def until_done(stop: threading.Event, forward: Awaitable[T]) -> T:
    """``forward``'s result. If the awaiting task is cancelled, set ``stop`` and wait for the forward to end (it
    checks ``stop`` at its next layer) before the cancellation goes on: the compute lock is not let go while a
    forward still runs."""
    work = asyncio.ensure_future(forward)
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


class TransferSink:
    """A ``LayerSink`` onto a prompt's transfer: where its forward puts its layers, from the forward's thread.
    Full-attention KV goes out once per token and only from ``link_start`` on (the decode node holds the
    tokens before it). Once ``stop`` is set, the next put raises ``Stopped`` in the forward."""

    def __init__(self, tx: OutgoingTransfer, link_start: int, total: int, stop: threading.Event | None = None) -> None:
        self.tx, self.link_start, self.total, self.stop = tx, link_start, total, stop
        self.nbytes = 0
        self.handed_tokens = 0  # the furthest token any layer has handed on
        self._sent: dict[int, int] = {}  # full-attention layer -> tokens [0, n) handed over (or skipped)

    def _check(self, end: int) -> None:
        if self.stop is not None and self.stop.is_set():
            raise Stopped(f"aborted after {self.handed_tokens} of {self.total} tokens")
        self.handed_tokens = max(self.handed_tokens, end)

    def put_layer(self, layer: LayerState) -> None:
        self._check(self.total)
        if self.link_start and layer.kind is StateKind.FULL_ATTENTION:
            layer = layer.slice_tokens(self.link_start, layer.seq_len)
        self.nbytes += layer.nbytes
        self.tx.put_threadsafe(layer)

    def put_tokens(self, piece: LayerState, start: int, forward_total: int) -> None:
        """Tokens [start, start + piece.seq_len) of a full-attention layer of the prompt (``forward_total``: the
        tokens of the forward that made them, which may be a segment of the prompt)."""
        end, skip = start + piece.seq_len, self.link_start
        self._check(end)
        first = max(start, self._sent.get(piece.layer, skip))
        if end <= first and end < self.total:
            return  # nothing new for the decode node
        piece = piece.slice_tokens(min(first, end) - start, piece.seq_len)
        self._sent[piece.layer] = end
        self.nbytes += piece.nbytes
        if first == skip and end == self.total:  # the whole part of the layer that crosses the link
            self.tx.put_threadsafe(piece)
        else:
            self.tx.put_threadsafe(piece, first - skip, self.total - skip)
