"""The prefill half of a request: carry out the router's decision, and fall back when it fails.

A prefill that fails (worker gone, link cut or stalled, too slow) is redone
on a PD-P worker not tried yet, or, when none is left, on a PrfaaS worker
while the link is up; the request's record says why. Before a PrfaaS
prefill the decode node pins the prefix it already holds, so only the rest of
the full-attention KV crosses the link; under the ABUNDANT rule the router may
first move a cached prefix to the prefill node's cluster.

The first token can reach the client before the state's tail has crossed:
the prefill worker sends it (``first``) as soon as its forwards are done, and
``EarlyFirst`` hands it to the gateway while the dispatch waits for the
transfer. Once the gateway has shown it, a prefill that then fails is redone
with that token as part of the prompt (as a migration does), and the retry's
first token is the one after it.

A decode worker that goes away meanwhile ends the attempt at once with
``DecodeLost`` (the prefill is stopped): the gateway migrates the request
(``serve.migration``) instead of retrying the prefill into a worker that is gone.

Transfer ids start at a random point of a 62-bit space, so a gateway that
restarted never reuses an id a worker may still remember from the one before.
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

from minifaas.control.worker_ops import sampling_to_json
from minifaas.gateway.inter_cluster_link import InterClusterLink
from minifaas.gateway.lifecycle import Phase, advance
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.migration import continued
from minifaas.gateway.prefix_directory import PrefixDirectory
from minifaas.gateway.requests import DecodeLost, GenerateRequest, RequestFailed, RequestRecord
from minifaas.gateway.worker_handle import WorkerHandle
from minifaas.gateway.worker_pool import WorkerPool
from minifaas.policy.codec_policy import CodecChoice
from minifaas.policy.router import CacheMove, RouteDecision

log = logging.getLogger("minifaas.gateway")


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


class PrefillDispatch:
    def __init__(
        self,
        pool: WorkerPool,
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

        task = asyncio.ensure_future(self.run(request, record, decision, decode, early, settle))
        task.add_done_callback(lambda _: settle())
        return task

    async def run(
        self,
        request: GenerateRequest,
        record: RequestRecord,
        decision: RouteDecision,
        decode: WorkerHandle,
        early: EarlyFirst | None = None,
        counted: Callable[[], None] | None = None,
    ) -> Prefilled:
        """Prefill on the routed worker; if that fails, on a PD-P worker. ``early`` gets the first token
        before the transfer ends; if the gateway showed it and the prefill then fails, the retry prefills
        it too (the returned request says so). ``counted`` is called once the first attempt has counted the
        prompt on its worker (``start``)."""
        tried: set[str] = set()
        worker = self.pool.workers[decision.prefill_node]  # type: ignore[index]
        expected_hit = decision.cached_tokens
        worker.claims += 1  # held until _once opens its inbox, so a drain cannot end in between
        try:
            moved = await self._move(request, record, decision.cache_move, worker) if decision.cache_move else None
        finally:
            worker.release()
        while True:
            record.route = "prfaas" if worker.cluster == "prfaas" else "local"
            record.prefill_worker = worker.name
            record.phase = advance(record.phase, Phase.PREFILLING)
            transfer = next(self.transfer_ids)
            outcome = await self._once(request, record, worker, decode, transfer, expected_hit, moved, early, counted)
            moved, counted = None, None  # a retry elsewhere does not take the move
            if isinstance(outcome, int):
                return Prefilled(transfer, outcome, request)
            if not decode.alive:
                raise DecodeLost(f"decode worker {decode.name} went away during the prefill ({outcome})")
            tried.add(worker.name)
            log.warning("request %s: prefill on %s failed (%s)", request.request_id, worker.name, outcome)
            record.phase = advance(record.phase, Phase.FALLBACK)
            reason = outcome.split(":")[0]
            record.fallback = reason
            self.fallbacks[reason] += 1
            with contextlib.suppress(RuntimeError):
                decode.send({"op": "abort", "req": request.request_id})
            if early is not None and early.withdraw():  # the client has the first token: go on after it
                request, early = continued(request, [early.show()]), None
                record.events.append("prefill failed after its first token was sent: redone with it")
            worker = self._retry_on(request, tried)
            if worker is None:
                raise RequestFailed(f"prefill failed on every worker tried: {outcome}")
            hits = self.prefixes.node_hits(request.prompt_ids)
            expected_hit = hits.get(worker.name, 0)

    def _retry_on(self, request: GenerateRequest, tried: set[str]) -> WorkerHandle | None:
        """Where a failed prefill goes next: a PD-P worker not tried yet, else a PrfaaS one while the link
        is up (a PD-P that died must not fail a request PrfaaS can serve); the least loaded net of its hit."""
        hits = self.prefixes.node_hits(request.prompt_ids)
        for cluster in ("pd", "prfaas"):
            if cluster == "prfaas" and not self.link.up:
                break
            left = [w for w in self.pool.of(cluster, "prefill") if w.serving and w.name not in tried]
            if left:
                return min(left, key=lambda w: w.load_tokens - hits.get(w.name, 0))
        return None

    async def _once(
        self,
        request: GenerateRequest,
        record: RequestRecord,
        worker: WorkerHandle,
        decode: WorkerHandle,
        transfer: int,
        expected_hit: int,
        moved: int | None = None,
        early: EarlyFirst | None = None,
        counted: Callable[[], None] | None = None,
    ) -> int | str:
        """The first token, or why this attempt failed."""
        rid, n = request.request_id, len(request.prompt_ids) - expected_hit  # the tokens it will compute
        sampling = sampling_to_json(request.sampling)
        inbox = worker.open(rid)
        worker.load_tokens += n
        if counted is not None:
            counted()
        reply: dict | None = None
        answered = False  # the prefill's own answer came (not only its early first token)
        # only the inter-cluster link is worth a round trip to the decode node to pin its prefix first,
        # and only it is worth coding for (the cluster's own network is not the bottleneck)
        remote = worker.cluster == "prfaas"
        link_start = self.prefixes.kv_prefix(request.prompt_ids, decode.name) if remote else 0
        choice: CodecChoice | None = None
        asked = time.perf_counter()
        gone = decode.gone  # this session's: a decode worker that came back does not know the request
        try:
            if not decode.alive:
                raise DecodeLost(f"decode worker {decode.name} is not attached")
            decode.send(
                {
                    "op": "decode",
                    "req": rid,
                    "transfer": transfer,
                    "sampling": sampling,
                    "tokens": request.prompt_ids,
                    "link_start": link_start,
                }
            )
            if link_start:
                link_start = await self._pinned(decode, rid, transfer)
            if remote:
                choice = self.scheduler.codec(len(request.prompt_ids), n, link_start)
            worker.send(
                {
                    "op": "prefill",
                    "req": rid,
                    "transfer": transfer,
                    "tokens": request.prompt_ids,
                    "sampling": sampling,
                    "kv": self.link.kv_address(worker, decode),
                    "link_start": link_start,
                    "codec": choice.codec if choice is not None else "none",
                    "seen_tokens": self.prefixes.seen_prefix(request.prompt_ids),
                    **({"import": moved} if moved is not None else {}),
                }
            )
            sent = time.perf_counter()
            async with asyncio.timeout(self.prefill_timeout):
                while (reply := await _unless_gone(inbox, gone)) is not None and not _answers(reply, transfer):
                    if reply["op"] == "first" and reply.get("transfer") == transfer:
                        if early is not None:
                            early.offer(int(reply["next_token"]))
                        continue
                    worker.unclaimed(reply)  # an earlier attempt's (a migrated request keeps its id)
            replied = time.perf_counter()
            answered = reply is not None
            if reply is None:
                raise DecodeLost(f"decode worker {decode.name} went away during the prefill")
        except TimeoutError:
            return "timeout: prefill and transfer took too long"
        except RuntimeError as e:
            return f"worker_down: {e}"
        finally:
            worker.load_tokens -= n
            worker.close(rid)
            if not answered:  # timed out, or the client left: stop the prefill rather than let it run on
                with contextlib.suppress(RuntimeError):
                    worker.send({"op": "abort", "req": rid})
        if reply["op"] == "lost":
            return f"worker_lost: {worker.name} went away"
        if reply["op"] == "failed":
            return f"transfer_failed: {reply['error']}"
        record.kv_bytes = reply["kv_bytes"]
        record.kv_codec, record.kv_codec_reason = reply["codec"], choice.reason if choice is not None else "local"
        record.kv_wire_bytes, record.kv_encode_s, record.kv_decode_s = (
            reply["kv_wire_bytes"], reply["kv_encode_s"], reply["kv_decode_s"]
        )  # fmt: skip
        if remote:
            self.scheduler.coded(reply, reply["kv_bytes"])
        record.cached_tokens = reply["cached_tokens"]
        self.metrics.add_kv_bytes(f"{worker.cluster}->{decode.name}", reply["kv_bytes"])
        record.queue_s, record.prefill_s, record.transfer_s = (
            reply["queue_s"],
            reply["prefill_s"],
            reply["transfer_tail_s"],
        )
        record.dispatch_s = (record.dispatch_s or 0.0) + sent - asked
        record.store_s = reply["worker_s"] - reply["prefill_s"] - reply["transfer_tail_s"]
        record.control_s = max(0.0, replied - sent - reply["queue_s"] - reply["worker_s"])
        self.scheduler.prefilled(worker.cluster, reply["computed_tokens"], reply["prefill_s"])
        record.phase = advance(record.phase, Phase.TRANSFERRING)
        return int(reply["next_token"])

    async def _move(
        self, request: GenerateRequest, record: RequestRecord, move: CacheMove, dst: WorkerHandle
    ) -> int | None:
        """Carry out the router's cache move: the source cluster's node with the longest hit sends that
        prefix's state to ``dst`` across the link. Returns the transfer ``dst`` takes it from, or None."""
        rid, transfer = request.request_id, next(self.transfer_ids)
        hits = self.prefixes.node_hits(request.prompt_ids)
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
                {"op": "export", "req": rid, "transfer": transfer, "tokens": tokens, "length": length, "kv": link,
                 "codec": codec}
            )  # fmt: skip
            async with asyncio.timeout(self.prefill_timeout):
                reply = await inbox.get()
        except (TimeoutError, RuntimeError) as e:
            reply = {"op": "failed", "error": repr(e)}
        finally:
            src.close(rid)
        if reply["op"] != "exported" or not reply["tokens"]:
            log.warning("request %s: cache move %s -> %s failed: %s", rid, src.name, dst.name, reply.get("error"))
            self.cache_moves["failed"] += 1
            return None
        self.cache_moves["done"] += 1
        self.cache_moves["bytes"] += reply["bytes"]
        self.scheduler.coded(reply, reply["bytes"])
        self.metrics.add_kv_bytes(f"{src.name}->{dst.name}", reply["bytes"])
        record.events.append(f"cache_move {src.name}->{dst.name} {reply['tokens']} tokens")
        return transfer

    async def _pinned(self, decode: WorkerHandle, rid: str, transfer: int) -> int:
        """Tokens of the prompt whose KV the decode node has pinned: the prefill sends only the rest."""
        inbox = decode.inboxes[rid]
        async with asyncio.timeout(self.prefill_timeout):
            while True:
                msg = await inbox.get()
                if msg["op"] == "lost":
                    raise DecodeLost(f"decode worker {decode.name} went away before pinning its prefix")
                if msg["op"] == "failed" and msg.get("transfer") == transfer:
                    raise RuntimeError(f"decode worker {decode.name}: {msg.get('error', 'went away')}")
                if msg["op"] == "pinned" and msg["transfer"] == transfer:
                    return int(msg["tokens"])


def _answers(reply: dict, transfer: int) -> bool:
    """The reply is this prefill's: its outcome for this transfer, or the worker's session lost."""
    return reply["op"] == "lost" or (reply["op"] in ("prefilled", "failed") and reply.get("transfer") == transfer)


async def _unless_gone(inbox: asyncio.Queue[dict], gone: asyncio.Event) -> dict | None:
    """The next reply in ``inbox``, or None as soon as ``gone`` is set (the decode worker's session ended)."""
    get, lost = asyncio.ensure_future(inbox.get()), asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({get, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        get.cancel()
        lost.cancel()
    return None if gone.is_set() or not get.done() or get.cancelled() else get.result()
