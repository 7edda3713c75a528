"""Where a failed prefill goes next: the retry seam around ``PrefillDispatch.prefill``.

A failed attempt is recorded and redone on a PD-P worker not tried yet, else on a PrfaaS one while the link is
up; with none left it waits, within the request's first-token deadline, for a worker or the link to come back.
"""

from __future__ import annotations

import contextlib
import logging

from minifaas.cache.prefix_index import PrefixDirectory, PromptKeys
from minifaas.control.worker_ops import Abort
from minifaas.gateway.inter_cluster_link import InterClusterLink
from minifaas.gateway.migration import DecodeLost, continued
from minifaas.gateway.requests import GenerateRequest, Phase, RequestRecord
from minifaas.gateway.token_stream import EarlyFirst
from minifaas.gateway.worker_handle import WorkerHandle
from minifaas.gateway.workers import WAIT_POLL_S, Workers

log = logging.getLogger("minifaas.gateway")
WAITING = "prefill failed on every worker it could go to: waiting for one to come back"
Tried = dict[str, tuple[int, int]]  # each failed worker's name, with its ``generation`` when it failed


class PrefillFailed(Exception):
    """An attempt at a prefill failed; the message is ``reason: detail``, the reason one of /metrics' labels."""


class Fallback:
    def __init__(self, pool: Workers, link: InterClusterLink, prefixes: PrefixDirectory) -> None:
        self.pool, self.link, self.prefixes = pool, link, prefixes

    async def next(
        self,
        request: GenerateRequest,
        keys: PromptKeys | None,
        worker: WorkerHandle,
        decode: WorkerHandle,
        record: RequestRecord,
        why: str,
        early: EarlyFirst | None,
        tried: Tried,
    ) -> tuple[GenerateRequest, PromptKeys | None, WorkerHandle, int, EarlyFirst | None]:
        """The prefill of ``request`` on ``worker`` failed (``why``): record it, release the decode side, and
        return what to prefill next, where, the hit it may load there, and the early first token still to offer.
        Raises DecodeLost when the decode worker went away."""
        rid = request.request_id
        tried[worker.name] = self.generation(worker)
        if not decode.alive:
            raise DecodeLost(f"decode worker {decode.name} went away during the prefill ({why})")
        log.warning("request %s: prefill on %s failed (%s)", rid, worker.name, why)
        record.events.append(f"prefill on {worker.name} failed: {why}")
        record.phase = Phase.FALLBACK
        record.fallback = why.split(":")[0]
        with contextlib.suppress(RuntimeError):
            decode.send(Abort(req=rid))
        if early is not None and early.withdraw():  # the client has the first token: go on after it
            request, early = continued(request, [early.show()]), None
            keys = self.prefixes.keys(request.prompt_ids)
            record.events.append("prefill failed after its first token was sent: redone with it")
        while (found := self._next_worker(keys, tried)) is None:
            if not decode.alive:
                raise DecodeLost(f"decode worker {decode.name} went away while the prefill waited ({why})")
            if record.note(WAITING):
                log.warning("request %s: no prefill worker left to try (%s); waiting for one", rid, why)
            await self.pool.changed(WAIT_POLL_S)
        return request, keys, *found, early

    def generation(self, w: WorkerHandle) -> tuple[int, int]:
        """What must change before a worker that failed a prefill is worth another try: it came back (rejoins),
        or, across the link, the link did."""
        return w.rejoins, self.link.generation if w.cluster == "prfaas" else 0

    def _next_worker(self, keys: PromptKeys | None, tried: Tried) -> tuple[WorkerHandle, int] | None:
        """A PD-P worker not tried yet (or back since it failed), else a PrfaaS one while the link is up; the
        least loaded net of its hit. None: none left."""
        hits = self.prefixes.node_hits(keys)
        for cluster in ("pd", "prfaas"):
            if cluster == "prfaas" and not self.link.up:
                break
            workers = self.pool.of(cluster, "prefill")
            left = [w for w in workers if w.serving and tried.get(w.name) != self.generation(w)]
            if left:
                worker = min(left, key=lambda w: w.load_tokens - hits.get(w.name, 0))
                return worker, hits.get(worker.name, 0)
        return None
