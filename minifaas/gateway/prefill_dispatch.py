"""The prefill half of a request: carry out the router's decision, and fall back when it fails.

``_once`` is the happy path: the decode node told to expect the state (and to pin the prefix it holds, so only
the rest crosses the link), the prefill node asked to compute and send it, its reply awaited. Around it,
``_tried`` counts the worker's load and turns a failure into its reason, ``_recorded`` writes the reply's
figures to the record, the scheduler and /metrics, and ``run`` redoes a failed prefill on a PD-P worker not
tried yet, else on a PrfaaS one while the link is up; with none left, it waits within the request's
first-token deadline for one to come back (``_retry_on``). Under the ABUNDANT rule ``_move`` first brings a
cached prefix into the prefill node's cluster. A transfer whose link goes out of service fails at once.

The first token can reach the client before the state's tail has crossed (``EarlyFirst``); once it was shown,
a prefill that then fails is redone with that token in the prompt, as a migration does. A decode worker that
goes away ends the attempt with ``DecodeLost``: the gateway migrates the request. Transfer ids start at a
random point of a 62-bit space, so a restarted gateway never reuses one a worker may still remember.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from minifaas.cache.block_hash import PromptKeys
from minifaas.control.worker_ops import Op, Reply, sampling_to_json
from minifaas.gateway.inter_cluster_link import NAME, InterClusterLink, LinkDown
from minifaas.gateway.lifecycle import Phase, advance
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.migration import continued
from minifaas.gateway.prefix_directory import PrefixDirectory
from minifaas.gateway.requests import DecodeLost, GenerateRequest, RequestRecord
from minifaas.gateway.worker_handle import WorkerHandle
from minifaas.gateway.workers import Workers
from minifaas.launch.launcher import WorkerError
from minifaas.policy.codec_policy import CodecChoice
from minifaas.policy.router import CacheMove, RouteDecision

log = logging.getLogger("minifaas.gateway")
OnFirst = Callable[[int], None]  # told the first token as soon as the prefill worker has it
WAIT_POLL_S = 0.25  # with every worker tried, how often to look again for one back (or the link back)
WAITING = "prefill failed on every worker it could go to: waiting for one to come back"


class LinkScheduler(Protocol):
    """What dispatch asks of the live scheduler: a codec for each transfer across the link, and what came of it."""

    def codec(self, tokens: int = 0, computed: int = 0, link_start: int = 0) -> CodecChoice: ...

    def coded(self, reply: dict, nbytes: int) -> None: ...

    def prefilled(self, cluster: str, tokens: int, seconds: float) -> None: ...


class EarlyFirst:
    """A prefill's first token as soon as its worker has it, and whether the gateway has shown it.

    Both sides act on it without awaiting in between, so on the one event loop a token is either shown
    (and a failed prefill is redone after it) or withdrawn (and never shown)."""

    def __init__(self) -> None:
        self.token: int | None = None
        self.shown = False
        self.arrived = asyncio.Event()

    def offer(self, token: int) -> None:
        if not self.shown:
            self.token = token
            self.arrived.set()

    def show(self) -> int:
        """The gateway sends the token to the client: from now on the prefill must continue after it."""
        assert self.token is not None
        self.shown = True
        return self.token

    def withdraw(self) -> bool:
        """The attempt that offered the token failed: drop it unless it was shown. Returns ``shown``."""
        if not self.shown:
            self.token = None
            self.arrived.clear()
        return self.shown


@dataclass(frozen=True, slots=True)
class Prefilled:
    transfer: int
    first: int  # the first token after ``request``'s prompt
    request: GenerateRequest  # what was prefilled: the attempt's, or it with a shown early token appended


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
    moved: int | None = None  # the transfer a cache move brought the prefix in under
    choice: CodecChoice | None = None  # the codec across the link (None within a cluster)
    asked: float = 0.0  # perf_counter when the decode node was asked, the prefill sent, the reply in
    sent: float = 0.0
    replied: float = 0.0

    @property
    def remote(self) -> bool:
        """Across the link: only it is worth a round trip to pin the decode node's prefix, and worth coding for."""
        return self.worker.cluster == "prfaas"


class PrefillDispatch:
    def __init__(
        self,
        pool: Workers,
        link: InterClusterLink,
        prefixes: PrefixDirectory,
        metrics: ServeMetrics,
        prefill_timeout: float,
        scheduler: LinkScheduler,
    ) -> None:
        self.pool, self.link, self.prefixes, self.metrics = pool, link, prefixes, metrics
        self.prefill_timeout, self.scheduler = prefill_timeout, scheduler
        self.transfer_ids = itertools.count(secrets.randbits(62))
        self.fallbacks: Counter[str] = Counter()
        self.cache_moves: Counter[str] = Counter()

    def start(
        self,
        request: GenerateRequest,
        keys: PromptKeys | None,
        record: RequestRecord,
        decision: RouteDecision,
        decode: WorkerHandle,
        early: EarlyFirst | None = None,
    ) -> asyncio.Task[Prefilled]:
        """``run`` as a task, with the prompt counted on its prefill worker at once: the task starts a turn
        of the loop later, and a request routed meanwhile must see this one's load."""
        worker, pending = self.pool.workers[decision.prefill_node], [len(request.prompt_ids) - decision.cached_tokens]
        worker.load_tokens += pending[0]

        def settle() -> None:  # the first attempt has counted the prompt itself, or the task ended before
            worker.load_tokens -= pending[0]
            pending[0] = 0

        task = asyncio.ensure_future(self.run(request, keys, record, decision, decode, early, settle))
        task.add_done_callback(lambda _: settle())
        return task

    async def run(
        self,
        request: GenerateRequest,
        keys: PromptKeys | None,
        record: RequestRecord,
        decision: RouteDecision,
        decode: WorkerHandle,
        early: EarlyFirst | None = None,
        counted: Callable[[], None] | None = None,
    ) -> Prefilled:
        """Prefill on the routed worker; if that fails, on another (``_retry_on``). ``early`` gets the first
        token before the transfer ends; if the gateway showed it and the prefill then fails, the retry prefills
        it too (the returned request says so). ``counted`` is called once the first attempt has counted the
        prompt on its worker (``start``)."""
        worker = self.pool.workers[decision.prefill_node]  # type: ignore[index]
        hit, tried = decision.cached_tokens, dict[str, tuple[int, int]]()
        worker.claims += 1  # held until _tried opens its inbox, so a drain cannot end in between
        try:
            move = decision.cache_move
            moved = await self._move(request, keys, record, move, worker) if move is not None else None
        finally:
            worker.release()
        while True:
            record.route = "prfaas" if worker.cluster == "prfaas" else "local"
            record.prefill_worker = worker.name
            record.phase = advance(record.phase, Phase.PREFILLING)
            link_start = decision.decode_kv_tokens if worker.cluster == "prfaas" else 0
            n = len(request.prompt_ids) - hit
            attempt = Attempt(request, keys, worker, decode, next(self.transfer_ids), n, link_start, moved)
            outcome = await self._tried(attempt, None if early is None else early.offer, counted)
            if isinstance(outcome, dict):
                return Prefilled(attempt.transfer, self._recorded(attempt, record, outcome), request)
            moved, counted = None, None  # a retry elsewhere does not take the move
            tried[worker.name] = self._generation(worker)
            self._fell_back(attempt, record, outcome)
            if early is not None and early.withdraw():  # the client has the first token: go on after it
                request, early = continued(request, [early.show()]), None
                keys = self.prefixes.keys(request.prompt_ids)
                record.events.append("prefill failed after its first token was sent: redone with it")
            worker, hit = await self._retry_on(keys, tried, outcome, record, decode)

    async def _once(self, a: Attempt, on_first: OnFirst | None) -> dict:
        """The happy path: the decode node told to expect the state (and to pin the prefix it holds), the prefill
        node asked to compute and send it; returns the prefill worker's reply (``prefilled``, ``failed``, ``lost``)."""
        rid, prompt, inbox = a.request.request_id, a.request.prompt_ids, a.worker.inboxes[a.request.request_id]
        gone = a.decode.gone  # this session's: a decode worker that came back does not know the request
        a.asked = time.perf_counter()
        if not a.decode.alive:
            raise DecodeLost(f"decode worker {a.decode.name} is not attached")
        sampling = sampling_to_json(a.request.sampling)
        try:  # its session may have ended before the pool noticed: the decode side is gone, not this prefill
            a.decode.send({"op": Op.DECODE, "req": rid, "transfer": a.transfer, "sampling": sampling,
                           "tokens": prompt, "link_start": a.link_start})  # fmt: skip
        except WorkerError as e:
            raise DecodeLost(str(e)) from None
        if a.link_start:
            a.link_start = await self._pinned(a.decode, rid, a.transfer)
        if a.remote:
            a.choice = self.scheduler.codec(len(prompt), a.computed, a.link_start)
        a.worker.send({"op": Op.PREFILL, "req": rid, "transfer": a.transfer, "tokens": prompt, "sampling": sampling,
                       "kv": self.link.kv_address(a.worker, a.decode), "link_start": a.link_start,
                       "codec": a.choice.codec if a.choice is not None else "none",
                       "seen_tokens": self.prefixes.seen_prefix(a.keys),
                       **({"import": a.moved} if a.moved is not None else {})})  # fmt: skip
        a.sent = time.perf_counter()
        cut = self.link.cut if a.remote else None  # this outage's: a link back since does not end the attempt
        async with asyncio.timeout(self.prefill_timeout):
            reply = await _reply(inbox, gone, a, on_first, cut)
        a.replied = time.perf_counter()
        if reply is None and cut is not None and cut.is_set():
            raise LinkDown(f"the link went out of service during the transfer: {self.link.down.get(NAME)}")
        if reply is None:
            raise DecodeLost(f"decode worker {a.decode.name} went away during the prefill")
        return reply

    async def _tried(self, a: Attempt, on_first: OnFirst | None, counted: Callable[[], None] | None) -> dict | str:
        """``_once`` with the prompt counted on the worker and its inbox open: the ``prefilled`` reply, or why the
        attempt failed. An attempt that ends with no reply (timed out, or the client left) stops its prefill."""
        rid = a.request.request_id
        a.worker.open(rid)
        a.worker.load_tokens += a.computed
        if counted is not None:
            counted()
        reply: dict | None = None
        try:
            reply = await self._once(a, on_first)
        except TimeoutError:
            return "timeout: prefill and transfer took too long"
        except LinkDown as e:
            return f"link_down: {e}"
        except RuntimeError as e:
            return f"worker_down: {e}"
        finally:
            a.worker.load_tokens -= a.computed
            a.worker.close(rid)
            if reply is None:  # stop the prefill rather than let it run on
                with contextlib.suppress(RuntimeError):
                    a.worker.send({"op": Op.ABORT, "req": rid})
        if reply["op"] == Reply.LOST:
            return f"worker_lost: {a.worker.name} went away"
        if reply["op"] == Reply.FAILED:
            return f"transfer_failed: {reply['error']}"
        return reply

    def _recorded(self, a: Attempt, record: RequestRecord, reply: dict) -> int:
        """The prefill's figures into the record, the scheduler and /metrics; returns the first token."""
        record.kv_bytes, record.cached_tokens = reply["kv_bytes"], reply["cached_tokens"]
        record.kv_codec, record.kv_codec_reason = reply["codec"], a.choice.reason if a.choice is not None else "local"
        record.kv_wire_bytes, record.kv_encode_s, record.kv_decode_s = (
            reply["kv_wire_bytes"], reply["kv_encode_s"], reply["kv_decode_s"]
        )  # fmt: skip
        if a.remote:
            self.scheduler.coded(reply, reply["kv_bytes"])
        link = f"{a.worker.cluster}->{a.decode.name}"
        self.metrics.add_kv_bytes(link, reply["kv_bytes"], reply["kv_wire_bytes"], reply["codec"])
        record.queue_s, record.prefill_s, record.transfer_s = (
            reply["queue_s"],
            reply["prefill_s"],
            reply["transfer_tail_s"],
        )
        record.dispatch_s = (record.dispatch_s or 0.0) + a.sent - a.asked
        record.store_s = reply["worker_s"] - reply["prefill_s"] - reply["transfer_tail_s"]
        record.control_s = max(0.0, a.replied - a.sent - reply["queue_s"] - reply["worker_s"])
        self.scheduler.prefilled(a.worker.cluster, reply["computed_tokens"], reply["prefill_s"])
        record.phase = advance(record.phase, Phase.TRANSFERRING)
        return int(reply["next_token"])

    def _fell_back(self, a: Attempt, record: RequestRecord, why: str) -> None:
        """The attempt failed: DecodeLost if its decode worker went away, else say why and release the decode side."""
        if not a.decode.alive:
            raise DecodeLost(f"decode worker {a.decode.name} went away during the prefill ({why})")
        log.warning("request %s: prefill on %s failed (%s)", a.request.request_id, a.worker.name, why)
        record.events.append(f"prefill on {a.worker.name} failed: {why}")
        record.phase = advance(record.phase, Phase.FALLBACK)
        reason = why.split(":")[0]
        record.fallback = reason
        self.fallbacks[reason] += 1
        with contextlib.suppress(RuntimeError):
            a.decode.send({"op": Op.ABORT, "req": a.request.request_id})

    def _generation(self, w: WorkerHandle) -> tuple[int, int]:
        """What must change before a worker that failed a prefill is worth another try: it came back (rejoins),
        or, across the link, the link did."""
        return w.rejoins, self.link.generation if w.cluster == "prfaas" else 0

    async def _retry_on(
        self,
        keys: PromptKeys | None,
        tried: dict[str, tuple[int, int]],
        why: str,
        record: RequestRecord,
        decode: WorkerHandle,
    ) -> tuple[WorkerHandle, int]:
        """Where a failed prefill goes next, and the hit it may load there (``_next_worker``). With none left it
        waits for a worker, or the link, to come back: the caller's first-token deadline bounds the wait, and
        the decode worker going away ends it (the request migrates)."""
        while (found := self._next_worker(keys, tried)) is None:
            if not decode.alive:
                raise DecodeLost(f"decode worker {decode.name} went away while the prefill waited ({why})")
            if record.note(WAITING):
                log.warning("request %s: no prefill worker left to try (%s); waiting for one", record.request_id, why)
            await self.pool.changed(WAIT_POLL_S)
        return found

    def _next_worker(
        self, keys: PromptKeys | None, tried: dict[str, tuple[int, int]]
    ) -> tuple[WorkerHandle, int] | None:
        """A PD-P worker not tried yet (or back since it failed), else a PrfaaS one while the link is up (a PD-P
        that died must not fail a request PrfaaS can serve); the least loaded net of its hit. None: none left."""
        hits = self.prefixes.node_hits(keys)
        for cluster in ("pd", "prfaas"):
            if cluster == "prfaas" and not self.link.up:
                break
            workers = self.pool.of(cluster, "prefill")
            left = [w for w in workers if w.serving and tried.get(w.name) != self._generation(w)]
            if left:
                worker = min(left, key=lambda w: w.load_tokens - hits.get(w.name, 0))
                return worker, hits.get(worker.name, 0)
        return None

    async def _move(
        self,
        request: GenerateRequest,
        keys: PromptKeys | None,
        record: RequestRecord,
        move: CacheMove,
        dst: WorkerHandle,
    ) -> int | None:
        """Carry out the router's cache move: the source cluster's node with the longest hit sends that
        prefix's state to ``dst`` across the link. Returns the transfer ``dst`` takes it from, or None."""
        rid, transfer = request.request_id, next(self.transfer_ids)
        hits = self.prefixes.node_hits(keys)
        sources = [w for w in self.pool.workers.values() if w.cluster == move.src and w.serving and hits.get(w.name, 0)]
        link = self.link.move_address(dst)
        if not sources or link is None:
            self.cache_moves["no_source"] += 1
            return None
        src = max(sources, key=lambda w: (hits[w.name], w.name))
        inbox = src.open(rid)
        try:
            tokens, length, codec = request.prompt_ids, move.end_tokens, self.scheduler.codec().codec
            src.send(
                {"op": Op.EXPORT, "req": rid, "transfer": transfer, "tokens": tokens, "length": length, "kv": link,
                 "codec": codec}
            )  # fmt: skip
            async with asyncio.timeout(self.prefill_timeout):
                reply = await inbox.get()
        except (TimeoutError, RuntimeError) as e:
            reply = {"op": Reply.FAILED, "error": repr(e)}
        finally:
            src.close(rid)
        if reply["op"] != Reply.EXPORTED or not reply["tokens"]:
            log.warning("request %s: cache move %s -> %s failed: %s", rid, src.name, dst.name, reply.get("error"))
            self.cache_moves["failed"] += 1
            return None
        self.cache_moves["done"] += 1
        self.cache_moves["bytes"] += reply["bytes"]
        self.scheduler.coded(reply, reply["bytes"])
        self.metrics.add_kv_bytes(f"{src.name}->{dst.name}", reply["bytes"], reply["kv_wire_bytes"], reply["codec"])
        record.events.append(f"cache_move {src.name}->{dst.name} {reply['tokens']} tokens")
        return transfer

    async def _pinned(self, decode: WorkerHandle, rid: str, transfer: int) -> int:
        """Tokens of the prompt whose KV the decode node has pinned: the prefill sends only the rest."""
        inbox = decode.inboxes[rid]
        async with asyncio.timeout(self.prefill_timeout):
            while True:
                msg = await inbox.get()
                if msg["op"] == Reply.LOST:
                    raise DecodeLost(f"decode worker {decode.name} went away before pinning its prefix")
                if msg["op"] == Reply.FAILED and msg.get("transfer") == transfer:
                    raise RuntimeError(f"decode worker {decode.name}: {msg.get('error', 'went away')}")
                if msg["op"] == Reply.PINNED and msg["transfer"] == transfer:
                    return int(msg["tokens"])


async def _reply(
    inbox: asyncio.Queue[dict], gone: asyncio.Event, a: Attempt, on_first: OnFirst | None, cut: asyncio.Event | None
) -> dict | None:
    """The prefill's outcome for ``a``'s transfer, or the worker's session lost; None once the decode worker is
    ``gone`` or the link is ``cut``. On the way the early first token goes to ``on_first``, an earlier attempt's
    replies to ``unclaimed`` (a migrated request keeps its id)."""
    ends = [gone] if cut is None else [gone, cut]
    while (msg := await _unless(inbox, ends)) is not None and not _answers(msg, a.transfer):
        if msg["op"] == Reply.FIRST and msg.get("transfer") == a.transfer:
            if on_first is not None:
                on_first(int(msg["next_token"]))
        else:
            a.worker.unclaimed(msg)
    return msg


def _answers(reply: dict, transfer: int) -> bool:
    """The reply is this prefill's: its outcome for this transfer, or the worker's session lost."""
    return reply["op"] == Reply.LOST or (
        reply["op"] in (Reply.PREFILLED, Reply.FAILED) and reply.get("transfer") == transfer
    )


async def _unless(inbox: asyncio.Queue[dict], ends: list[asyncio.Event]) -> dict | None:
    """The next reply in ``inbox``, or None as soon as one of ``ends`` is set (the first: the decode worker's
    session ended; the second: the link was cut)."""
    get = asyncio.ensure_future(inbox.get())
    waits = [asyncio.ensure_future(e.wait()) for e in ends]
    try:
        await asyncio.wait({get, *waits}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (get, *waits):
            task.cancel()
    if ends[0].is_set() or not get.done() or get.cancelled():  # a reply that came as the link went still counts
        return None
    return get.result()
