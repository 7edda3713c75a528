"""A prefill worker's job: run prompts through the model and stream each layer's state as it is made.

One forward runs at a time (prefill is compute-bound; a second one would only
halve both), and waiting prompts take their turn in arrival order. The lock is
held for the compute and the pool's copies only: while the tail of one
request's state is still on the wire, the next prompt is already running.

With a prefix store, a prompt loads the usable hit from the node's pool when
its turn comes (so it sees everything the prompts before it stored), computes
only the rest, and stores its blocks and snapshots before the next prompt's
turn. That store runs beside the transfer's tail and the reply (``_keep``), so
no request's first token waits for it: a cache that nothing reuses costs a
request only the lookup. The worker tells the gateway of the pool's
store/evict events.

An aborted request (its client left, or the gateway gave up on it) stops its
prefill: a waiting prompt leaves the queue, and a running forward stops at
the next layer that hands state on (``LayerForwarder`` raises ``Stopped``
from the model's hook; with ``chunk_tokens=0`` only the last segment hands
state on, so earlier snapshot segments run to their end). The compute lock
is let go only once the forward's thread has really ended, and the open
transfer is reset, so the decode node frees what arrived. Nothing of a
stopped prompt goes into the pool.

Chunked prefill (``chunk_tokens``): every forward of the prompt (the snapshot
segments too, which are chunks already) runs in pieces of at most that many
tokens, and each piece's full-attention keys and values go on the wire as soon
as the piece has passed the layer; linear-attention and sliding-window state
go when the last piece is done. The transfer then trails the prefill by about
one piece's KV plus the fixed-size state instead of the last whole layer.
``chunk_tokens=0`` is the reference: the snapshot segments run before the
transfer opens, and the last segment streams whole layers.

Cache moves across the link (the ABUNDANT rule): ``export`` sends a prefix
state from this node's pool to a node of the other cluster, whose ``prefill``
first takes it off its receiver (``import``) and keeps it in its pool, where the
prompt's turn then finds it like any other hit. A move that fails is logged and
counted, and the prompt is prefilled without it.

KV compression: the gateway names a codec per transfer (``"codec"`` in the
message; the scheduler chose it, ``policy.compression``). The worker uses it
when its own ``--kv-compression`` allows it (``codecs``), else the nearest it
allows, and reports the bytes before and after and the coding time at both
ends. At start it measures its codecs once on a real state
(``calibrate``), so the scheduler has figures before the first request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from minifaas.codec.codec import Codec, usable
from minifaas.control.worker_ops import sampling_from_json
from minifaas.model.host_copy import HostCopier
from minifaas.model.layer_state import LayerState, ModelState, StateKind
from minifaas.model.runtime import ModelRuntime, OnLayer, OnTokens
from minifaas.model.sampling import GREEDY, SamplingParams
from minifaas.net.errors import TransferError
from minifaas.transport.codec_probe import probe
from minifaas.transport.outgoing import TransferReport
from minifaas.transport.receiver import KVReceiver
from minifaas.transport.sender import KVSender
from minifaas.transport.sender_config import SenderConfig
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
    ) -> None:
        if chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
        # without full attention nothing can stream before the last token: chunks would only cost, and the
        # transfer would sit open with nothing on it
        self.chunk_tokens = chunk_tokens if any(kind.grows for kind in store.layout) else 0
        self.runtime, self.secret, self.store = runtime, secret, store
        self.receiver, self.import_timeout = receiver, import_timeout
        self.connections, self.pipelined = connections, pipelined
        self.codecs = codecs | {Codec.NONE}
        self.senders: dict[tuple[str, int], KVSender] = {}
        self.compute = asyncio.Lock()  # one prompt computes at a time; held until the pool has kept its part
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
        """Prefill ``msg["tokens"]`` and stream the state. ``first`` gets the first token (``{"op": "first"}``)
        as soon as the forwards are done, ahead of the transfer's tail and the reply. Cancelling the task
        aborts the request: the forward stops early and ``stopped_at[req]`` says how far it got."""
        tokens: list[int] = msg["tokens"]
        sampling = sampling_from_json(msg["sampling"])
        sender = self.sender(*msg["kv"])
        arrived = time.perf_counter()
        if "import" in msg:
            await self._import(tokens, msg["import"])
        stop = threading.Event()
        forward: LayerForwarder | None = None
        held, queued, keeping = False, True, False  # the compute lock; the prompt in queued_tokens; the pool's task

        def unqueue() -> None:  # once the forwards are done, or on the way out if they never ran or ended
            nonlocal queued
            if queued:
                queued = False
                self.queued_tokens -= len(tokens)

        def unlock() -> None:  # the next prompt's turn: after the pool has kept this one's part
            nonlocal held
            if held:
                held = False
                self.compute.release()

        self.queued_tokens += len(tokens)
        try:
            await self.compute.acquire()
            held = True
            started = time.perf_counter()
            plan = self.store.begin(tokens, started, msg.get("seen_tokens", 0))
            try:
                if not self.chunk_tokens:  # the snapshot segments, before the transfer: nothing of them streams
                    await self._until_stopped(stop, self.store.advance, self.runtime, plan)
                codec = self.codec(msg)
                async with sender.stream(msg["transfer"], layers=self.runtime.num_states, codec=codec) as tx:
                    link_start = msg.get("link_start", 0)
                    forward = LayerForwarder(tx.put_threadsafe, tx.put_tokens_threadsafe, link_start, len(tokens), stop)
                    try:
                        computed = await self._until_stopped(
                            stop, compute_streaming, self.store, self.runtime, plan, forward, self.chunk_tokens,
                            sampling,
                        )  # fmt: skip
                    finally:
                        unqueue()
                    computed_at = time.perf_counter()
                    if first is not None:  # the client may see it while the tail is still on the wire
                        first({"op": "first", "req": msg["req"], "transfer": msg["transfer"],
                               "next_token": computed.result.next_token})  # fmt: skip
                    # the pool keeps its part while the transfer's tail drains and the reply goes out
                    self._keep(plan, computed, unlock)
                    keeping = True
                finished = time.perf_counter()
            finally:
                if not keeping:
                    self.store.release(plan)
        except asyncio.CancelledError:
            self.stopped_at[msg["req"]] = forward.handed_tokens if forward is not None else 0
            raise
        finally:
            unqueue()
            if not keeping:
                unlock()
        assert forward is not None and tx.report is not None
        result = computed.result
        return {
            "op": "prefilled",
            "req": msg["req"],
            "transfer": msg["transfer"],
            "next_token": result.next_token,
            "kv_bytes": forward.nbytes,
            "cached_tokens": plan.hit_tokens,
            "computed_tokens": result.computed_tokens,
            "queue_s": started - arrived,
            "prefill_s": result.seconds,
            "transfer_tail_s": finished - computed_at,
            "worker_s": finished - started,
            **coding(tx.report),
        }

    async def _until_stopped(self, stop: threading.Event, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the runtime's forward thread. If the awaiting task is cancelled, set ``stop`` and
        wait for the thread to end (a forward checks ``stop`` at its next layer) before the cancellation goes
        on: the compute lock must not be let go while a forward still runs."""
        work = asyncio.ensure_future(self.runtime.on_forward_thread(fn, *args))
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

    def _keep(self, plan: CachedPrefill, computed: Computed, unlock: Callable[[], None]) -> None:
        """Copy out (on the forward thread) and store what the pool keeps of a computed prompt, then let the next
        prompt compute: it sees this one's blocks. Nobody waits on it for a first token."""

        async def keep() -> None:
            try:
                if not computed.cut:  # nothing to copy with the cache off: no thread hop either
                    await self.runtime.on_forward_thread(self.store.cut, plan, computed)
                self.store.finish(plan, computed, time.perf_counter())
            except Exception:  # the prompt was answered; only its cache entries are lost
                log.exception("storing a prompt's prefix in the pool failed")
            finally:
                self.store.release(plan)
                unlock()
                if self.kept is not None:
                    self.kept()

        task = asyncio.ensure_future(keep())
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
        reply = {"op": "exported", "req": msg["req"], "tokens": lease.hit_tokens, "bytes": nbytes}
        return reply | (coding(report) if report is not None else {})

    async def close(self) -> None:
        await asyncio.gather(*self._keeping, return_exceptions=True)
        for sender in self.senders.values():
            await sender.__aexit__(None, None, None)


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
