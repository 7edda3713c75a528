"""A request that outlives its decode worker: what it has sent so far, and what it asks of the next one.

When the decode worker goes away, the prompt plus every token already sent is prefilled again and decoding goes
on elsewhere, asking only for the tokens still owed. A request that seems to crash the workers it lands on is
stopped (``PoisonRequest``); one with presence or frequency penalties fails rather than migrate.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.requests import GenerateRequest, Phase, RequestFailed, RequestRecord

if TYPE_CHECKING:
    from minifaas.gateway.worker_handle import Lost
    from minifaas.gateway.workers import Workers

log = logging.getLogger("minifaas.gateway")


POISON_LOSSES = 2  # decode workers lost right after taking a request alone into their batch: then it is the cause


class DecodeLost(RequestFailed):
    """The decode worker holding the request went away: the request may migrate. ``suspect``: the worker
    ended while this request, and no other, waited for its first step there (``POISON_LOSSES``)."""

    def __init__(self, message: str, worker: str | None = None, suspect: bool = False, pid: int = 0) -> None:
        super().__init__(message)
        self.worker, self.suspect, self.pid = worker, suspect, pid


def suspect(lost: Lost, rid: str) -> bool:
    """Whether the decode worker's loss points at this request: the worker ended (a silent one may have been
    stopped before it read anything) while this request, and no other, waited for its first step there."""
    return not lost.silent and lost.unstepped == (rid,)


class MigrationLimit(RequestFailed):
    """The request lost its decode worker more often than ``--migration-limit`` allows (HTTP 503, retryable)."""


class PoisonRequest(RequestFailed):
    """Decode workers died one after another just as they took this request into their batch: it is stopped as
    their likely cause, before it takes down another (HTTP 500, not retryable)."""


class Migration:
    def __init__(self, request: GenerateRequest, limit: int | None, sent: list[int] | None = None) -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"the migration limit must be >= 0, got {limit}")
        self.original, self.limit = request, limit
        self.sent = [] if sent is None else sent  # tokens the client has been sent, across every decode worker
        self.moves = 0
        self.suspect_losses: list[str] = []  # decode workers that died before one step of it

    def request(self) -> GenerateRequest:
        """What the current attempt asks for: the prompt plus what was sent, and only the tokens still owed."""
        return continued(self.original, self.sent)

    def move(self, lost: DecodeLost) -> None:
        """The decode worker is gone: count a move, or raise PoisonRequest, MigrationLimit (or DecodeLost) when
        none is allowed."""
        if self.original.sampling.penalised and self.sent:
            raise DecodeLost(f"{lost}; a request with presence or frequency penalties cannot migrate") from lost
        if lost.suspect:
            self.suspect_losses.append(lost.worker or "?")
            if len(self.suspect_losses) >= POISON_LOSSES:
                raise PoisonRequest(
                    f"{lost}; decode workers {', '.join(self.suspect_losses)} each died just as they took this "
                    "request, and no other, into their batch: it is stopped as the likely cause"
                ) from lost
        if self.limit is not None and self.moves >= self.limit:
            raise MigrationLimit(
                f"{lost}; the request already moved {self.moves} time(s), the migration limit ({self.limit})"
            ) from lost
        self.moves += 1


async def migrate(
    moving: Migration, record: RequestRecord, lost: DecodeLost, metrics: ServeMetrics, pool: Workers
) -> GenerateRequest:
    """Move the request to another decode worker: what the next attempt asks for. Raises when it may not move."""
    if lost.suspect and lost.worker:  # a worker killed from outside is no evidence against the request
        lost.suspect = await pool.ended_by_itself(lost.worker, lost.pid)
    try:
        moving.move(lost)
    except RequestFailed:
        metrics.migration("refused")
        raise
    record.migrations = moving.moves
    record.phase = Phase.MIGRATING
    record.events.append(f"migrated from {record.decode_worker} after {len(moving.sent)} tokens")
    metrics.migration("moved")
    log.warning("request %s: %s; migrating with %d tokens sent", record.request_id, lost, len(moving.sent))
    return moving.request()


def continued(request: GenerateRequest, sent: list[int]) -> GenerateRequest:
    """``request`` after ``sent`` went to the client: those tokens join the prompt, and only the rest is owed."""
    if not sent:
        return request
    p, n = request.sampling, len(sent)
    sampling = dataclasses.replace(p, max_tokens=p.max_tokens - n, min_tokens=max(0, p.min_tokens - n))
    return dataclasses.replace(request, prompt_ids=request.prompt_ids + sent, sampling=sampling)
