"""One request's life through the gateway, top to bottom: admitted, routed (``route``), prefilled
(``PrefillDispatch``), streamed back from its decode worker (``decode_tokens``).

Its seams: ``migrate`` when the decode worker is lost, ``EarlyFirst`` for a first token shown before the state is
all across, and ``RequestDeadline`` around each wait. The ``Gateway`` builds the parts it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from minifaas.cache.prefix_index import PrefixDirectory, PromptKeys
from minifaas.config import ServeConfig
from minifaas.control.worker_ops import Abort
from minifaas.gateway.inter_cluster_link import InterClusterLink
from minifaas.gateway.live_scheduler import LiveScheduler
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.migration import DecodeLost, Migration, migrate
from minifaas.gateway.prefill_dispatch import PrefillDispatch
from minifaas.gateway.requests import (
    Admission,
    GenerateRequest,
    Phase,
    RequestDeadline,
    RequestFailed,
    RequestRecord,
    TokenEvent,
)
from minifaas.gateway.token_stream import EarlyFirst, OutputText, decode_tokens, first_token_finish, token_event
from minifaas.gateway.workers import WAIT_POLL_S, Workers
from minifaas.model.tokenizer import Tokenizer
from minifaas.policy.interfaces import RoutingPolicy
from minifaas.policy.router import ClusterView, NodeView, Path, RouteDecision, RouteInput

NO_ROUTE = "no worker to route to: waiting for one"


@dataclass(slots=True)
class Serving:
    """The parts a request runs through; ``config`` is read per request."""

    config: ServeConfig
    tokenizer: Tokenizer
    router: RoutingPolicy
    pool: Workers
    link: InterClusterLink
    prefixes: PrefixDirectory
    scheduler: LiveScheduler
    dispatch: PrefillDispatch
    admission: Admission
    metrics: ServeMetrics

    async def stream(self, request: GenerateRequest, record: RequestRecord) -> AsyncIterator[TokenEvent]:
        """A request's life: admitted, routed, prefilled, streamed; token events until one carries a finish_reason.
        A prompt that cannot be served (empty, or a token id outside the vocabulary) raises ValueError before
        anything runs; over HTTP, parse_request refuses both with a 400 first."""
        ids, vocab = request.prompt_ids, self.tokenizer.vocab_size
        if not ids:
            raise ValueError(f"request {request.request_id}: the prompt is empty")
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"request {request.request_id}: token id {bad} is outside the vocabulary [0, {vocab})")
        ticket = self.admission.admit(len(ids), time.monotonic())  # or Overloaded: a 503 with Retry-After
        start = time.perf_counter()
        c = self.config
        deadline = RequestDeadline(
            c.first_token_timeout, c.token_timeout, c.request_timeout, asyncio.get_running_loop().time()
        )
        text = OutputText(self.tokenizer, request.sampling)  # one text across decode workers: no token twice
        sent: list[int] = []  # every token the client was sent: what a migration continues after
        moving: Migration | None = None
        attempt = request
        try:
            while True:
                try:
                    async with contextlib.aclosing(self._attempt(attempt, record, text, deadline, start)) as events:
                        async for event in events:
                            sent.append(event.token_id)
                            self.admission.first_token(ticket, time.monotonic())
                            yield event
                    break
                except DecodeLost as lost:  # the migration seam: the same request on another decode worker
                    moving = moving or Migration(request, c.migration_limit, sent)
                    attempt = await migrate(moving, record, lost, self.metrics, self.pool)
            record.phase = Phase.FINISHED
        except RequestFailed:
            record.phase = Phase.FAILED
            raise
        finally:
            self.admission.release(ticket)
            record.e2e_s = time.perf_counter() - start
            self.scheduler.outputs.append(record.completion_tokens)
            if record.decode_worker is not None and not record.phase.done:
                record.phase = Phase.ABORTED

    async def _attempt(
        self, request: GenerateRequest, record: RequestRecord, text: OutputText, deadline: RequestDeadline,
        start: float,
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        """One decode worker's share of the request: route, prefill, stream until done or the worker is lost."""
        rid, decode, prefill = request.request_id, None, None
        # penalties count generated tokens only, so a prefill redone after a shown token would change them
        early = None if request.sampling.penalised else EarlyFirst()
        try:
            async with deadline.first_token():  # after a migration: the re-prefill, the client's wait
                if record.migrations:  # the lost one may be the only decode worker: wait for it back, not fail
                    await self.pool.serving("pd", "decode")
                keys = self.prefixes.keys(request.prompt_ids)  # hashed once: the route, the prefill, its retries
                while (decision := self.route(request.prompt_ids, keys)).path is Path.REJECT:
                    record.note(NO_ROUTE)  # no healthy worker can serve it: wait for one, within the deadline
                    await self.pool.changed(WAIT_POLL_S)
                decode = self.pool.workers[decision.decode_node]  # type: ignore[index]
                record.decode_worker, record.route_reason = decode.name, decision.reason.value
                inbox = decode.open(rid)
                if record.ttft_s is None:  # the breakdown is the first token's; a migration's prefill adds to it
                    record.dispatch_s = time.perf_counter() - start  # routing; the prefill dispatch adds its part
                prefill = self.dispatch.start(request, keys, record, decision, decode, early)
                if early is None:
                    await asyncio.wait({prefill})
                    shown = None
                else:  # the early-first-token seam: the first token while the state's tail is on its way
                    shown = await early.shown_before(
                        prefill, lambda t: first_token_finish(t, request, self.tokenizer) is not None
                    )
            if record.ttft_s is None:
                record.ttft_s = time.perf_counter() - start
            if shown is not None:
                event = token_event(shown, None, text, record)
                yield event
                if event.finish_reason is not None:  # a stop string in the first token's text
                    return
                async with deadline.first_token():  # the tail, or a prefill redone after the shown token
                    await asyncio.wait({prefill})
            done = prefill.result()
            record.phase = Phase.DECODING
            sent = shown is not None and done.request is request  # else it was redone after the shown token
            async for event in decode_tokens(done, record, self.tokenizer, decode, inbox, deadline, text, sent):
                yield event
        finally:
            if decode is not None:  # told first, so the decode side expects the stopped prefill's hang-up
                with contextlib.suppress(RuntimeError):  # frees the row if a stop string or the client ended it
                    decode.send(Abort(req=rid))
            if prefill is not None and not prefill.done():  # the client left, or a deadline passed
                prefill.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await prefill
            if decode is not None:
                decode.close(rid)

    def route(self, prompt_ids: list[int], keys: PromptKeys | None) -> RouteDecision:
        """The router's decision, on each prefill node's usable hit and each decode node's KV prefix (what a
        transfer to it need not carry)."""
        matches = self.prefixes.matches(keys)
        hits = {node: m.hit_tokens for node, m in matches.items()}
        kv = {node: m.kv_prefix_tokens for node, m in matches.items()}

        def nodes(cluster: str, role: str) -> tuple[NodeView, ...]:
            held = hits if role == "prefill" else kv
            return tuple(
                NodeView(w.name, held.get(w.name, 0), w.load_tokens, w.serving) for w in self.pool.of(cluster, role)
            )

        prfaas = ClusterView("prfaas", prefill_nodes=nodes("prfaas", "prefill"))
        pd = ClusterView("pd", prefill_nodes=nodes("pd", "prefill"), decode_nodes=nodes("pd", "decode"))
        link = dict(link_up=self.link.up, link_utilisation=self.scheduler.utilisation,  # a spill needs room on it
                    link_backlog_s=self.dispatch.link_backlog_s())  # fmt: skip
        t, rule = self.scheduler.threshold, self.scheduler.rule
        decision = self.router.route(RouteInput(len(prompt_ids), t, rule, prfaas, pd, **link))
        if decision.path is not Path.REJECT:
            self.scheduler.lengths.append(decision.incremental_tokens)
        return decision
