"""A prefill worker's job: run prompts through the model and stream each layer's state as it is made.

The core (``_run``): load the prompt's cached prefix, run the rest on the forward thread, hand each layer's
state to the sender as it is made, report. With ``chunk_tokens`` every forward runs in chunks and each chunk's
full-attention KV goes out once it has passed the layer; with 0 the snapshot segments run before the transfer
opens and the last segment streams by layer. ``export`` sends a cached prefix to another cluster's node, whose
``prefill`` takes it in first (``import``; a move that fails is logged, counted and done without).

Around the core: one prompt computes at a time, in arrival order (``_turn``); the first token goes out once
the forwards end; the pool keeps the prompt's blocks and snapshots beside the transfer's tail, the compute lock
held until they are in so the next prompt sees them (``_keep``). An abort takes a waiting prompt out of the
queue or stops a running forward at its next layer that hands state on (``_until_stopped``), lets the lock go
only once that forward's thread has ended, resets the transfer and stores nothing. Codecs: the gateway's, if
allowed, else the nearest (``calibrate`` measures each). Short prompts queued at once may ride in the forward of
the one whose turn came (``prefill_batch``, with ``batch_tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from minifaas.codec.codec import Codec, usable
from minifaas.control.worker_ops import Reply, sampling_from_json
from minifaas.model.host_copy import HostCopier
from minifaas.model.layer_state import LayerState, ModelState, StateKind
from minifaas.model.runtime import ModelRuntime, OnLayer, OnTokens
from minifaas.model.sampling import GREEDY, SamplingParams
from minifaas.net.errors import TransferError
from minifaas.transport.codec_probe import probe
from minifaas.transport.outgoing import KVSender, SenderConfig, TransferReport
from minifaas.transport.receiver import KVReceiver
from minifaas.worker.prefill_batch import Batcher, PrefillBatch, until_done
from minifaas.worker.prefix_store import CachedPrefill, Computed, PrefixStore

log = logging.getLogger("minifaas.prefill")
T = TypeVar("T")
CALIBRATION_PROMPT = [(37 * i + 11) % 256 for i in range(256)]  # token ids every preset's vocabulary holds


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
        import_timeout: float = 30.0,
        chunk_tokens: int = 0,  # prefill in forwards of at most this many tokens, streaming each (0: one forward)
        codecs: frozenset[Codec] = frozenset(),  # the codecs this worker may send with (none always)
        batch_tokens: int = 0,  # queued prompts of one length share a forward of at most this many tokens (0: not)
    ) -> None:
        if chunk_tokens < 0 or batch_tokens < 0:
            raise ValueError(f"chunk_tokens and batch_tokens must be >= 0, got {chunk_tokens}, {batch_tokens}")
        # without full attention nothing can stream before the last token: chunks would only cost, and the
        # transfer would sit open with nothing on it
        self.chunk_tokens = chunk_tokens if any(kind.grows for kind in store.layout) else 0
        self.runtime, self.secret, self.store = runtime, secret, store
        self.receiver, self.import_timeout = receiver, import_timeout
        self.connections, self.pipelined = connections, pipelined
        self.codecs = codecs | {Codec.NONE}
        self.senders: dict[tuple[str, int], KVSender] = {}
        self.compute = asyncio.Lock()  # one prompt computes at a time; held until the pool has kept its part
        self.batcher = Batcher(self.compute, runtime, store, batch_tokens)  # the queue for it, and its batches
        self.queued_tokens = 0
        self._keeping: set[asyncio.Task[None]] = set()  # stores into the pool still under way
        self.kept: Callable[[], None] | None = None  # called after each store (the session sends the pool's news)
        self.stopped_at: dict[str, int] = {}  # aborted request -> prompt tokens its forward had handed on

    def sender(self, host: str, port: int) -> KVSender:
        key = (host, port)
        if key not in self.senders:
            config = SenderConfig(host, port, self.secret, connections=self.connections, pipelined=self.pipelined)
            self.senders[key] = KVSender(config)
        return self.senders[key]

    async def prefill(self, msg: dict, first: Callable[[dict], None] | None = None) -> dict:
        """Prefill ``msg["tokens"]``, stream the state to ``msg["kv"]``; the ``prefilled`` reply. ``first`` gets
        the first token (``{"op": "first"}``) as soon as the forwards are done, ahead of the transfer's tail.
        Cancelling the task aborts the request: the forward stops early, ``stopped_at[req]`` says how far."""
        job = _Job(msg, sampling_from_json(msg["sampling"]), self.sender(*msg["kv"]), time.perf_counter(), first)
        if "import" in msg:
            await self._import(job.tokens, msg["import"])
        async with self._turn(job):
            return await self._run(job)

    async def _run(self, job: _Job) -> dict:
        """The core: load the cached prefix, run the forwards, hand each layer's state to the sender, report."""
        msg, tokens, stop = job.msg, job.tokens, job.stop
        if job.batch is None:  # else a batch ahead took it along, planned
            job.plan = self.store.begin(tokens, job.started, msg.get("seen_tokens", 0))
            self.batcher.gather(job)
        if not self.chunk_tokens and job.batch is None:  # the snapshot segments, before the transfer
            await self._until_stopped(stop, self.store.advance, self.runtime, job.plan)
        connections = self.batcher.connections(job, self.connections)  # a batch's states are a few chunks each
        async with job.sender.stream(msg["transfer"], self.runtime.num_states, 0, self.codec(msg), connections) as tx:
            link_start = msg.get("link_start", 0)
            job.forward = LayerForwarder(tx.put_threadsafe, tx.put_tokens_threadsafe, link_start, len(tokens), stop)
            computed = await (self._forwards(job) if job.batch is None else self.batcher.row(job, job.forward, stop))
            self._forwarded(job, computed)
        assert tx.report is not None
        return _prefilled(job, computed, tx.report, time.perf_counter())

    @contextlib.asynccontextmanager
    async def _turn(self, job: _Job) -> AsyncIterator[None]:
        """The prompt's turn at the compute lock, in arrival order. However the prompt ends, what it still holds
        is given back (the pool's task gives back what it took over), and an aborted one's progress is kept."""
        self.queued_tokens += len(job.tokens)
        job.queued = True
        try:
            job.held = await self.batcher.turn(job)
            job.started = time.perf_counter()
            yield
        except asyncio.CancelledError:
            self.stopped_at[job.msg["req"]] = job.forward.handed_tokens if job.forward is not None else 0
            raise
        finally:
            if job.batch is not None:
                job.batch.leave(job)
            if not job.keeping and job.plan is not None:
                self.store.release(job.plan)
            self._unqueue(job)
            if not job.keeping:
                self._unlock(job)

    async def _forwards(self, job: _Job) -> Computed:
        """The forwards that stream; once they end, however they end, the prompt no longer counts as queued."""
        try:
            return await self._until_stopped(
                job.stop, compute_streaming, self.store, self.runtime, job.plan, job.forward, self.chunk_tokens,
                job.sampling,
            )  # fmt: skip
        finally:
            self._unqueue(job)

    def _forwarded(self, job: _Job, computed: Computed) -> None:
        """The forwards are done: the first token goes out (the client may see it while the tail is still on the
        wire), and the pool keeps its part while the transfer's tail drains and the reply goes out."""
        job.computed_at = time.perf_counter()
        if job.first is not None:
            msg = job.msg
            job.first({"op": Reply.FIRST, "req": msg["req"], "transfer": msg["transfer"],
                       "next_token": computed.result.next_token})  # fmt: skip
        self._keep(job, computed)

    def _unqueue(self, job: _Job) -> None:
        if job.queued:
            job.queued = False
            self.queued_tokens -= len(job.tokens)

    def _unlock(self, job: _Job) -> None:
        """The next prompt's turn."""
        if job.held:
            job.held = False
            self.compute.release()

    async def _until_stopped(self, stop: threading.Event, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the runtime's forward thread. If the awaiting task is cancelled, set ``stop`` and
        wait for the thread to end (a forward checks ``stop`` at its next layer) before the cancellation goes
        on: the compute lock must not be let go while a forward still runs."""
        return await until_done(stop, asyncio.ensure_future(self.runtime.on_forward_thread(fn, *args)))

    def _keep(self, job: _Job, computed: Computed) -> None:
        """Copy out (on the forward thread) and store what the pool keeps of a computed prompt, then let the next
        prompt compute: it sees this one's blocks. Nobody waits on it for a first token. It takes the prompt's
        plan and compute lock over from ``_turn``."""
        plan = job.plan
        assert plan is not None

        async def keep() -> None:
            try:
                if not computed.cut:  # nothing to copy with the cache off: no thread hop either
                    await self.runtime.on_forward_thread(self.store.cut, plan, computed)
                self.store.finish(plan, computed, time.perf_counter())
            except Exception:  # the prompt was answered; only its cache entries are lost
                log.exception("storing a prompt's prefix in the pool failed")
            finally:
                self.store.release(plan)
                self._unlock(job)
                if self.kept is not None:
                    self.kept()

        task = asyncio.ensure_future(keep())
        job.keeping = True
        self._keeping.add(task)
        task.add_done_callback(self._keeping.discard)

    def codec(self, msg: dict) -> Codec:
        """The codec the gateway asked for, or the nearest this worker allows."""
        return usable(Codec.named(msg.get("codec", "none")), frozenset(self.codecs))

    def calibrate(self) -> dict[str, list[float]]:
        """Each codec this worker may use, measured once on the state of a real prefill: what the
        scheduler starts from (nbytes, wire bytes, encode s, decode s). Blocking: run it in a thread."""
        state = self.runtime.prefill(CALIBRATION_PROMPT).state
        copier = HostCopier(self.runtime.device)
        state = ModelState([copier.to_host(s) for s in state.layers], state.seq_len)
        return {c.label: probe(state, c).to_json() for c in sorted(self.codecs - {Codec.NONE})}

    async def _import(self, tokens: list[int], transfer: int) -> None:
        if self.receiver is None:
            self.store.pool.counts["moves_refused"] += 1
            return
        try:
            async with asyncio.timeout(self.import_timeout):
                state = await self.receiver.transfer(transfer).model_state()
        except (TransferError, TimeoutError) as e:
            log.warning("cache move %d did not arrive (%s): prefilling without it", transfer, e)
            self.store.pool.counts["moves_lost"] += 1
            return
        self.store.import_state(tokens, state, time.perf_counter())
        self.store.pool.counts["moves_imported"] += 1

    async def export(self, msg: dict) -> dict:
        """Send the usable prefix of ``tokens`` up to ``length`` to another cluster's node."""
        lease, state = self.store.export_state(msg["tokens"], msg["length"], time.perf_counter())
        try:
            report = None
            if state is not None:
                report = await self.sender(*msg["kv"]).send(msg["transfer"], state, self.codec(msg))
        finally:
            self.store.pool.release(lease)
        nbytes = state.nbytes if state is not None else 0
        reply = {"op": Reply.EXPORTED, "req": msg["req"], "tokens": lease.hit_tokens, "bytes": nbytes}
        return reply | (coding(report) if report is not None else {})

    async def close(self) -> None:
        await asyncio.gather(*self._keeping, return_exceptions=True)
        for sender in self.senders.values():
            await sender.__aexit__(None, None, None)


@dataclass(slots=True)
class _Job:
    """A prompt on its way through the service, and what it holds of it, so that it gives back just that."""

    msg: dict
    sampling: SamplingParams
    sender: KVSender
    arrived: float
    first: Callable[[dict], None] | None  # gets the first token
    stop: threading.Event = field(default_factory=threading.Event)  # set on abort: the forward stops
    started: float = 0.0  # its turn at the compute came
    computed_at: float = 0.0  # its forwards were done
    queued: bool = False  # its tokens count in queued_tokens
    held: bool = False  # it holds the compute lock
    keeping: bool = False  # the pool's task has taken its plan and the lock over
    plan: CachedPrefill | None = None  # its pinned hit
    forward: LayerForwarder | None = None  # how far its forward got
    adopted: asyncio.Future[None] | None = None  # set when a batch ahead of it takes it along
    batch: PrefillBatch | None = None  # the batch whose forward computes it (it may lead it)

    @property
    def tokens(self) -> list[int]:
        return self.msg["tokens"]


def _prefilled(job: _Job, computed: Computed, report: TransferReport, finished: float) -> dict:
    """The reply: the first token, what the cache saved, where the time went, what the codec did."""
    assert job.plan is not None and job.forward is not None
    result = computed.result
    return {
        "op": Reply.PREFILLED,
        "req": job.msg["req"],
        "transfer": job.msg["transfer"],
        "next_token": result.next_token,
        "kv_bytes": job.forward.nbytes,
        "cached_tokens": job.plan.hit_tokens,
        "computed_tokens": result.computed_tokens,
        "queue_s": job.started - job.arrived,
        "prefill_s": result.seconds,
        "transfer_tail_s": finished - job.computed_at,
        "worker_s": finished - job.started,
        **coding(report),
    }


def coding(report: TransferReport) -> dict:
    """What a reply says of a transfer's codec: its name, the bytes on the wire, the time on each end."""
    return {
        "codec": report.codec,
        "kv_wire_bytes": report.wire_bytes,
        "kv_encode_s": report.encode_s,
        "kv_decode_s": report.decode_s,
    }


def compute_streaming(
    store: PrefixStore,
    runtime: ModelRuntime,
    plan: CachedPrefill,
    forward: LayerForwarder,
    chunk_tokens: int,
    sampling: SamplingParams = GREEDY,
) -> Computed:
    """The rest of ``plan``'s prompt, streamed to ``forward``: with ``chunk_tokens``, every forward in
    token chunks; without, the last segment by layer. Blocking: run it in a thread."""
    on_tokens = forward.tokens if chunk_tokens else None
    return store.compute(runtime, plan, forward, sampling, chunk_tokens, on_tokens)


class LayerForwarder:
    """Puts each finished layer, or new token range of a full-attention layer, on the wire.

    Full-attention KV goes only from ``link_start`` on, since the decode node
    already holds the tokens before it (incremental transfer). Token ranges may
    come from several forwards (segments of a prompt of ``total`` tokens), each
    of which hands over its prefix again: only the tokens not yet sent go out.
    """

    def __init__(
        self, put: OnLayer, put_tokens: OnTokens, link_start: int, total: int, stop: threading.Event | None = None
    ) -> None:
        self.put, self.put_tokens, self.link_start, self.total = put, put_tokens, link_start, total
        self.stop = stop
        self.nbytes = 0
        self.handed_tokens = 0  # the furthest token any layer has handed on
        self._sent: dict[int, int] = {}  # full-attention layer -> tokens [0, n) handed over (or skipped)

    def _check(self, end: int) -> None:
        if self.stop is not None and self.stop.is_set():
            raise Stopped(f"aborted after {self.handed_tokens} of {self.total} tokens")
        self.handed_tokens = max(self.handed_tokens, end)

    def __call__(self, layer: LayerState) -> None:
        self._check(self.total)
        if self.link_start and layer.kind is StateKind.FULL_ATTENTION:
            layer = layer.slice_tokens(self.link_start, layer.seq_len)
        self.nbytes += layer.nbytes
        self.put(layer)

    def tokens(self, piece: LayerState, start: int, _forward_total: int) -> None:
        """Tokens [start, start + piece.seq_len) of a full-attention layer of the prompt."""
        end, skip = start + piece.seq_len, self.link_start
        self._check(end)
        first = max(start, self._sent.get(piece.layer, skip))
        if end <= first and end < self.total:
            return  # nothing new for the decode node
        piece = piece.slice_tokens(min(first, end) - start, piece.seq_len)
        self._sent[piece.layer] = end
        self.nbytes += piece.nbytes
        if first == skip and end == self.total:  # the whole part of the layer that crosses the link
            self.put(piece)
        else:
            self.put_tokens(piece, first - skip, self.total - skip)
