"""The prefill half of a request: carry out the router's decision, and redo the prefill elsewhere when it fails.

``prefill`` is one attempt, top to bottom; ``run`` wraps it with the cache move and the retry seam
(``fallback``). A decode worker that goes away ends the attempt with ``DecodeLost``: the request migrates.
A transfer across the link is coded as the scheduler's codec policy picks (``codec``), and reports back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from minifaas.cache.prefix_index import PrefixDirectory, PromptKeys
from minifaas.config import ServeConfig
from minifaas.control.worker_ops import (
    Abort,
    Decode,
    Error,
    Exported,
    Failed,
    First,
    Pinned,
    Prefill,
    Prefilled,
    Sampling,
)
from minifaas.gateway.cache_move import CacheMoves
from minifaas.gateway.fallback import Fallback, PrefillFailed
from minifaas.gateway.inter_cluster_link import NAME, InterClusterLink, LinkDown, LinkNotReady
from minifaas.gateway.live_scheduler import LiveScheduler
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.migration import DecodeLost
from minifaas.gateway.requests import GenerateRequest, Phase, RequestFailed, RequestRecord
from minifaas.gateway.token_stream import EarlyFirst, Handoff
from minifaas.gateway.worker_handle import Inbound, Lost, WorkerHandle
from minifaas.gateway.workers import Workers
from minifaas.launch.launcher import WorkerError
from minifaas.model.layer_state import KVProfile
from minifaas.policy.codec_policy import CodecChoice, CodecSample, LinkShare, TransferShape
from minifaas.policy.router import RouteDecision
from minifaas.policy.signals import PrefillSample

OnFirst = Callable[[int], None]  # told the first token as soon as the prefill worker has it
SPEED_WEIGHT = 0.3  # of the newest prefill in the speed average: a few prefills follow a change of load


@dataclass(slots=True)
class Attempt:
    """One try at a request's prefill: ``worker`` computes what its cache lacks and sends the state to ``decode``."""

    request: GenerateRequest
    keys: PromptKeys | None  # the prompt's block keys (``PrefixDirectory.keys``)
    worker: WorkerHandle
    decode: WorkerHandle
    transfer: int
    computed: int  # prompt tokens the worker computes: all but the hit it is expected to load
    link_start: int  # the decode node holds the KV of tokens [0, link_start): only the rest is sent
    crossing: int = 0  # bytes of state it sends across the link (0 on PD-P)
    moved: int | None = None  # the transfer a cache move brought the prefix in under
    held: bool = False  # ``computed`` is counted in the worker's load, ``crossing`` on the link

    @property
    def remote(self) -> bool:
        """Across the link: only it is worth a round trip to pin the decode node's prefix, and worth coding for."""
        return self.worker.cluster == "prfaas"


class PrefillDispatch:
    def __init__(
        self, pool: Workers, link: InterClusterLink, prefixes: PrefixDirectory, metrics: ServeMetrics,
        config: ServeConfig, scheduler: LiveScheduler, kv: KVProfile,
    ) -> None:  # fmt: skip
        self.pool, self.link, self.prefixes, self.metrics = pool, link, prefixes, metrics
        self.prefill_timeout, self.scheduler = config.prefill_timeout, scheduler
        self.kv, self.prefill_chunk = kv, config.prfaas.prefill_chunk  # the model's state sizes: a transfer's shape
        # a random start in a 62-bit space: a restarted gateway never reuses an id a worker may still remember
        self.transfer_ids = itertools.count(secrets.randbits(62))
        self.link_bytes = 0  # what the attempts across the link are expected to put on the wire, until they end
        self.fallback = Fallback(pool, link, prefixes)
        self.moves = CacheMoves(pool, link, prefixes, metrics, self, self.prefill_timeout, self.transfer_ids)

    def attempt(
        self, request: GenerateRequest, keys: PromptKeys | None, worker: WorkerHandle, decode: WorkerHandle,
        hit: int, decision: RouteDecision,
    ) -> Attempt:  # fmt: skip
        remote = worker.cluster == "prfaas"
        link_start = decision.decode_kv_tokens if remote else 0
        computed = len(request.prompt_ids) - hit
        crossing = self.wire_bytes(len(request.prompt_ids), computed, link_start) if remote else 0
        return Attempt(request, keys, worker, decode, next(self.transfer_ids), computed, link_start, crossing)

    def hold(self, a: Attempt) -> None:
        """Count ``a``'s prompt in its worker's load and its state on the link, until ``let_go``."""
        if not a.held:
            a.worker.load_tokens += a.computed
            self.link_bytes += a.crossing
            a.held = True

    def let_go(self, a: Attempt) -> None:
        if a.held:
            a.worker.load_tokens -= a.computed
            self.link_bytes -= a.crossing
            a.held = False

    def start(
        self, request: GenerateRequest, keys: PromptKeys | None, record: RequestRecord, decision: RouteDecision,
        decode: WorkerHandle, early: EarlyFirst | None = None,
    ) -> asyncio.Task[Handoff]:  # fmt: skip
        """``run`` as a task, with the prompt counted on its prefill worker, and its state on the link, at once:
        the task starts a turn of the loop later, and a request routed meanwhile must see this one's load."""
        worker = self.pool.workers[decision.prefill_node]  # type: ignore[index]
        first = self.attempt(request, keys, worker, decode, decision.cached_tokens, decision)
        self.hold(first)
        task = asyncio.ensure_future(self.run(first, record, decision, early))
        task.add_done_callback(lambda _: self.let_go(first))  # it may end before the attempt lets go itself
        return task

    def link_backlog_s(self) -> float:
        """Seconds the link needs to carry what the attempts across it are expected to put on the wire."""
        rate = self.scheduler.link_rate_bps  # 0 while cut
        return 8 * self.link_bytes / rate if rate > 0 else math.inf if self.link_bytes else 0.0

    def state_bytes(self, tokens: int, link_start: int = 0) -> int:
        """The state a transfer carries for a ``tokens`` prompt whose decode node holds the KV before
        ``link_start``."""
        return self.kv.bytes_at(tokens) - (self.kv.bytes_at(link_start) - self.kv.bytes_at(0))

    def wire_bytes(self, tokens: int, computed: int, link_start: int) -> int:
        """What such a transfer is expected to put on the wire: its state over the ratio shown so far by the codec
        it would get now."""
        nbytes = self.state_bytes(tokens, link_start)
        shown = self.scheduler.compression.estimates.get(self.codec(tokens, computed, link_start).codec)
        return round(nbytes / shown.ratio) if shown is not None else nbytes

    async def run(
        self, a: Attempt, record: RequestRecord, decision: RouteDecision, early: EarlyFirst | None = None
    ) -> Handoff:
        """Prefill on the routed worker, or on the next the fallback finds. ``early`` gets the first token before
        the transfer ends; a retry after it was shown prefills it too (the returned request says so)."""
        if decision.cache_move is not None:
            a.worker.claims += 1  # held until the attempt opens its inbox, so a drain cannot end in between
            try:
                a.moved = await self.moves.carry_out(a.request, a.keys, record, decision.cache_move, a.worker)
            finally:
                a.worker.release()
        tried: dict[str, tuple[int, int]] = {}  # each failed worker, as it was then (``Fallback.generation``)
        while True:
            try:
                return await self.prefill(a, record, None if early is None else early.offer)
            except PrefillFailed as e:
                failed = e
            request, keys, worker, hit, early = await self.fallback.next(
                a.request, a.keys, a.worker, a.decode, record, str(failed), early, tried
            )
            a = self.attempt(request, keys, worker, a.decode, hit, decision)  # a retry does not take the move

    async def prefill(self, a: Attempt, record: RequestRecord, on_first: OnFirst | None) -> Handoff:
        """One attempt: the decode node told to expect the state, the prefill node asked to compute and send it,
        the reply awaited and recorded. Raises PrefillFailed saying why, DecodeLost when the decode worker went
        away. An attempt that ends with no reply (timed out, or the client left) stops its prefill."""
        rid, prompt, decode = a.request.request_id, a.request.prompt_ids, a.decode
        record.route, record.prefill_worker = "prfaas" if a.remote else "local", a.worker.name
        record.phase = Phase.PREFILLING
        inbox = a.worker.open(rid)
        self.hold(a)
        gone = decode.gone  # this session's: a decode worker that came back does not know the request
        reply: Prefilled | Failed | Lost | Error | None = None
        try:
            asked = time.perf_counter()
            if not decode.alive:
                raise DecodeLost(f"decode worker {decode.name} is not attached")
            sampling = Sampling.of(a.request.sampling)  # with the seed resolved: both workers sample alike
            try:  # its session may have ended before the pool noticed: the decode side is gone, not this prefill
                decode.send(Decode(req=rid, transfer=a.transfer, sampling=sampling, tokens=prompt,
                                   link_start=a.link_start))  # fmt: skip
            except WorkerError as e:
                raise DecodeLost(str(e)) from None
            link_start = await self._pinned(decode, rid, a.transfer) if a.link_start else 0
            choice = self.codec(len(prompt), a.computed, link_start) if a.remote else None
            if choice is not None:
                self.metrics.codec_chosen(choice.codec, choice.reason, choice.break_even_bps)
            kv = self.link.kv_routes.get(decode.name) if a.remote and self.link.emulated else decode.kv
            if kv is None:  # the emulator restarting, or the route not answered yet: the prefill falls back
                raise LinkNotReady(f"the link has no route to {decode.name} yet")
            a.worker.send(Prefill(req=rid, transfer=a.transfer, tokens=prompt, sampling=sampling,
                                  kv=kv, link_start=link_start,
                                  codec=choice.codec if choice is not None else "none",
                                  seen_tokens=self.prefixes.seen_prefix(a.keys), import_=a.moved))  # fmt: skip
            sent = time.perf_counter()
            cut = self.link.cut if a.remote else None  # this outage's: a link back since does not end the attempt
            async with asyncio.timeout(self.prefill_timeout):
                reply = await _outcome(inbox, a, on_first, gone, cut)
            replied = time.perf_counter()
            if reply is None and cut is not None and cut.is_set():
                raise LinkDown(f"the link went out of service during the transfer: {self.link.down.get(NAME)}")
            if reply is None:
                raise DecodeLost(f"decode worker {decode.name} went away during the prefill")
        except TimeoutError:
            raise PrefillFailed("timeout: prefill and transfer took too long") from None
        except LinkDown as e:
            raise PrefillFailed(f"link_down: {e}") from None
        except RuntimeError as e:
            raise PrefillFailed(f"worker_down: {e}") from None
        finally:
            self.let_go(a)
            a.worker.close(rid)
            if reply is None:  # stop the prefill rather than let it run on
                with contextlib.suppress(RuntimeError):
                    a.worker.send(Abort(req=rid))
        if isinstance(reply, Lost):
            raise PrefillFailed(f"worker_lost: {a.worker.name} went away")
        if isinstance(reply, Failed):
            raise PrefillFailed(f"transfer_failed: {reply.error}")
        if isinstance(reply, Error):  # any worker of this build refuses the same message: no retry
            raise RequestFailed(f"prefill worker {a.worker.name} refused the request: {reply.error}")
        self._recorded(a, record, reply, choice, replied - sent)
        if not record.migrations:
            record.dispatch_s = (record.dispatch_s or 0.0) + sent - asked
        return Handoff(a.transfer, reply.next_token, a.request)

    def _recorded(
        self, a: Attempt, record: RequestRecord, reply: Prefilled, choice: CodecChoice | None, round_trip: float
    ) -> None:
        """The prefill's figures into the scheduler, /metrics and the record (a migration's re-prefill not: the
        record's figures stay those of the prefill behind the first token)."""
        if a.remote:
            self.coded(reply, reply.kv_bytes)
        link = f"{a.worker.cluster}->{a.decode.name}"
        self.metrics.add_kv_bytes(link, reply.kv_bytes, reply.kv_wire_bytes, reply.codec)
        self._prefilled(a.worker.cluster, reply.computed_tokens, reply.prefill_s)
        record.phase = Phase.TRANSFERRING
        if record.migrations:
            return
        record.kv_bytes, record.cached_tokens = reply.kv_bytes, reply.cached_tokens
        record.kv_codec, record.kv_codec_reason = reply.codec, choice.reason if choice is not None else "local"
        record.kv_wire_bytes, record.kv_encode_s, record.kv_decode_s = (
            reply.kv_wire_bytes, reply.kv_encode_s, reply.kv_decode_s
        )  # fmt: skip
        record.queue_s, record.prefill_s = reply.queue_s, reply.prefill_s
        record.transfer_s = reply.transfer_tail_s
        record.store_s = reply.worker_s - reply.prefill_s - reply.transfer_tail_s
        record.control_s = max(0.0, round_trip - reply.queue_s - reply.worker_s)

    def codec(self, tokens: int = 0, computed: int = 0, link_start: int = 0) -> CodecChoice:
        """The codec for a transfer about to cross the link: the state of a ``tokens`` prompt from
        ``link_start`` on, ``computed`` of its tokens prefilled on PrfaaS (its own request already holds
        a PrfaaS worker). Without tokens, the rule for a transfer with nothing to hide behind."""
        s = self.scheduler
        busy = sum(w.busy for w in self.pool.of("prfaas", "prefill"))
        link = LinkShare(s.link_rate_bps, s.utilisation, max(0, busy - 1))
        shape = TransferShape(1.0)
        if tokens:
            nbytes = self.state_bytes(tokens, link_start)
            chunk = self.prefill_chunk  # the tail: the fixed state and the last chunk's KV
            tail = self.kv.bytes_at(min(chunk, computed)) if chunk else nbytes
            speed = s.speed.get("prfaas")
            shape = TransferShape(nbytes, computed / speed if speed else 0.0, tail)
        return s.compression.choose(link, shape)

    def coded(self, reply: Prefilled | Exported, nbytes: int) -> None:
        """A transfer across the link ended: what its codec did (a worker's ``coding`` fields)."""
        codec = reply.codec or "none"
        wire, encode_s, decode_s = reply.kv_wire_bytes, reply.kv_encode_s, reply.kv_decode_s
        self.scheduler.compression.observe(CodecSample(codec, nbytes, wire, encode_s, decode_s))
        self.metrics.kv_coded(codec, nbytes, wire, encode_s, decode_s)

    def _prefilled(self, cluster: str, tokens: int, seconds: float) -> None:
        """A prefill ended on ``cluster`` after ``seconds`` for ``tokens`` computed: the scheduler's sample and
        moving average of its speed."""
        if tokens <= 0 or seconds <= 0:
            return
        self.scheduler.prefills.append(PrefillSample(cluster, tokens, seconds))
        old, speed = self.scheduler.speed.get(cluster), tokens / seconds
        self.scheduler.speed[cluster] = speed if old is None else SPEED_WEIGHT * speed + (1 - SPEED_WEIGHT) * old

    async def _pinned(self, decode: WorkerHandle, rid: str, transfer: int) -> int:
        """Tokens of the prompt whose KV the decode node has pinned: the prefill sends only the rest."""
        inbox = decode.inboxes[rid]
        async with asyncio.timeout(self.prefill_timeout):
            while True:
                msg = await inbox.get()
                if isinstance(msg, Lost):
                    raise DecodeLost(f"decode worker {decode.name} went away before pinning its prefix")
                if isinstance(msg, Failed) and msg.transfer == transfer:
                    raise RuntimeError(f"decode worker {decode.name}: {msg.error}")
                if isinstance(msg, Error):
                    raise RequestFailed(f"decode worker {decode.name} refused the request: {msg.error}")
                if isinstance(msg, Pinned) and msg.transfer == transfer:
                    return msg.tokens


async def _outcome(
    inbox: asyncio.Queue[Inbound], a: Attempt, on_first: OnFirst | None, gone: asyncio.Event, cut: asyncio.Event | None
) -> Prefilled | Failed | Lost | Error | None:
    """The prefill's reply for ``a``'s transfer, the worker's refusal of the request, or its session lost; None
    once the decode worker is ``gone`` or the link is ``cut``. The early first token goes to ``on_first``, an
    earlier attempt's replies to ``unclaimed``."""
    while True:
        get = asyncio.ensure_future(inbox.get())
        waits = [asyncio.ensure_future(e.wait()) for e in (gone, cut) if e is not None]
        try:
            await asyncio.wait({get, *waits}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (get, *waits):
                task.cancel()
        if gone.is_set() or not get.done() or get.cancelled():  # a reply that came as the link went still counts
            return None
        msg = get.result()
        ours = getattr(msg, "transfer", None) == a.transfer
        if isinstance(msg, Lost | Error) or (isinstance(msg, (Prefilled, Failed)) and ours):
            return msg
        if isinstance(msg, First) and ours:
            if on_first is not None:
                on_first(msg.next_token)
        else:
            a.worker.unclaimed(msg)
