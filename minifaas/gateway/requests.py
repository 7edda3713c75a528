"""A request as the gateway holds it: what comes in, the token events that go out, the record of what happened,
its phases, its deadlines, the bounds it is admitted within, and the ways it can fail. Its lifecycle:

    QUEUED -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED
    PREFILLING / TRANSFERRING -> FALLBACK -> PREFILLING   (prefill node or link lost: re-prefill locally)
    any live state -> MIGRATING -> PREFILLING             (decode node lost: prompt + output so far re-prefilled)
    any live state -> ABORTED (client gone) | FAILED (no way left to answer)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from enum import Enum

from minifaas.config import ServeConfig
from minifaas.model.host_memory import available_bytes
from minifaas.model.sampling import SamplingParams

QUEUED_TOKEN_BYTES = 64  # what the gateway holds per prompt token in flight: its id, its share of the body and keys
MEMORY_SHARE = 0.25  # of the host memory available at start, the most the prompts in flight may take
RATE_SAMPLES = 64  # the latest first tokens that came while others waited: the rate is taken over them
MIN_RATE_SAMPLES = 16  # fewer: no rate known, the deadline bound is off
RATE_WINDOW_S = 60.0  # older ones are forgotten
MAX_RETRY_AFTER_S = 60


class Phase(Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    FALLBACK = "fallback"
    MIGRATING = "migrating"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (Phase.FINISHED, Phase.ABORTED, Phase.FAILED)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int
    text: str  # the text this token completes (may be "" inside a multi-byte character)
    finish_reason: str | None = None  # "stop" | "length" on the last event


@dataclass(slots=True)
class RequestRecord:
    """The ``minifaas`` object of a response: where the request went and what it cost. The prefill's round trip is
    dispatch_s + queue_s + prefill_s + store_s + transfer_s + control_s (and a few microseconds of bookkeeping);
    ttft_s is that less the transfer's tail and the reply when the first token went to the client ahead of them."""

    request_id: str
    prompt_tokens: int
    phase: Phase = Phase.QUEUED
    route: str | None = None  # "prfaas" | "local"
    route_reason: str | None = None  # the router's reason (policy.router.RouteReason), e.g. long_but_prfaas_down
    prefill_worker: str | None = None
    decode_worker: str | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    kv_bytes: int = 0  # of state
    kv_codec: str | None = None  # how it crossed the wire: none, lossless, fp8 or int8
    kv_codec_reason: str | None = None  # why (policy.codec_policy; "local" within a cluster)
    kv_wire_bytes: int = 0  # what crossed the wire after coding
    kv_encode_s: float = 0.0  # coding time at the prefill worker
    kv_decode_s: float = 0.0  # decoding time at the decode worker
    transfer_s: float | None = None  # the transfer's tail: from the prefill's end to the decode node's DONE
    queue_s: float | None = None  # waiting for the prefill worker's compute lock
    dispatch_s: float | None = None  # gateway: routing, pinning the decode node's prefix, the prefill message
    prefill_s: float | None = None  # the prefill worker's forwards
    store_s: float | None = None  # loading the prefix cache's hit, keeping snapshots, opening the transfer
    control_s: float | None = None  # the prefill round trip less the worker's queue, forwards and transfer tail
    first_step_s: float | None = None  # first token to second: the decode worker's first step and its hop back
    ttft_s: float | None = None
    e2e_s: float | None = None
    fallback: str | None = None  # why the request was re-prefilled locally, if it was
    migrations: int = 0  # times it moved to another decode worker after losing its own
    events: list[str] = field(default_factory=list)

    def note(self, event: str) -> bool:
        """Add ``event`` to the history unless it is the last one there (a wait noted once, not per look);
        True if it was added."""
        if self.events[-1:] == [event]:
            return False
        self.events.append(event)
        return True

    def to_json(self) -> dict:
        out = asdict(self)
        out["phase"] = self.phase.value
        out.pop("events")
        return out


class Overloaded(Exception):
    """No capacity to queue the request now (HTTP 503); ``retry_after``: seconds to wait before trying again."""

    def __init__(self, message: str = "", retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailed(Exception):
    """Every path to an answer failed (HTTP 500); the message says why."""


class DeadlineExceeded(RequestFailed):
    """The gateway was silent longer than a deadline allows, or the request outlived its total limit (HTTP 504)."""


class RequestDeadline:
    """The first token within one limit, each next one within another, all in an optional total from arrival.
    They bound the server's silence, not the length of the answer or the client's reading."""

    def __init__(self, first_token: float, between_tokens: float, total: float | None, now: float) -> None:
        self.first_token_s, self.between_tokens_s, self.total_s = first_token, between_tokens, total
        self._end = None if total is None else now + total

    def first_token(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self._within(self.first_token_s, f"no first token within {self.first_token_s:g} s")

    def next_token(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self._within(self.between_tokens_s, f"no token for {self.between_tokens_s:g} s")

    @contextlib.asynccontextmanager
    async def _within(self, seconds: float, silence: str) -> AsyncIterator[None]:
        until = asyncio.get_running_loop().time() + seconds
        why = silence
        if self._end is not None and self._end < until:
            until, why = self._end, f"the request took longer than its limit of {self.total_s:g} s"
        try:
            async with asyncio.timeout_at(until) as timeout:
                yield
        except TimeoutError:
            if not timeout.expired():
                raise  # a TimeoutError of something inside, not this deadline
            raise DeadlineExceeded(why) from None


@dataclass(slots=True)
class Ticket:
    """One admitted request: what it holds of the bounds, and whether its first token has come."""

    tokens: int
    waiting: bool = True


@dataclass(slots=True)
class Admission:
    """Takes a request in within bounds by count, by memory and by the first-token deadline; past one it is
    refused at once with ``Overloaded`` (HTTP 503 with Retry-After). Sans-IO: the gateway passes the clock in."""

    max_requests: int  # 0: no bound by count
    max_tokens: int  # prompt tokens in flight (0: no bound by memory)
    first_token_timeout: float
    requests: int = 0
    tokens: int = 0
    waiting: int = 0  # admitted requests still without a first token
    refused: int = 0
    _firsts: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))  # see RATE_SAMPLES

    @classmethod
    def of(cls, config: ServeConfig) -> Admission:
        """The bounds ``config`` sets, ``max_queued_tokens`` 0 sized by this host's memory now."""
        tokens = config.max_queued_tokens or tokens_memory_holds(available_bytes())
        return cls(config.max_queued_requests, tokens, config.first_token_timeout)

    def admit(self, prompt_tokens: int, now: float) -> Ticket:
        """A ticket for a request of ``prompt_tokens``, or Overloaded saying which bound it would pass."""
        if self.max_requests and self.requests >= self.max_requests:
            self._refuse(f"{self.requests} requests in flight, the limit", 1.0)
        if self.max_tokens and self.requests and self.tokens + prompt_tokens > self.max_tokens:
            self._refuse(f"{self.tokens} prompt tokens in flight; {prompt_tokens} more pass the limit", 1.0)
        rate = self.first_token_rate(now)
        if rate and (self.waiting + 1) / rate > self.first_token_timeout:
            wait = (self.waiting + 1) / rate
            self._refuse(
                f"{self.waiting} requests wait for a first token, about {wait:.0f} s at {rate:.1f}/s: more than "
                f"the first-token deadline of {self.first_token_timeout:g} s",
                wait - self.first_token_timeout,
            )
        self.requests += 1
        self.tokens += prompt_tokens
        self.waiting += 1
        return Ticket(prompt_tokens)

    def first_token(self, ticket: Ticket, now: float) -> None:
        """The ticket's request got its first token."""
        if ticket.waiting:
            ticket.waiting = False
            self.waiting -= 1
            if self.waiting:  # others still wait: how fast the queue drains
                self._firsts.append(now)

    def release(self, ticket: Ticket) -> None:
        """The request is over, however it ended."""
        if ticket.waiting:
            ticket.waiting = False
            self.waiting -= 1
        self.requests -= 1
        self.tokens -= ticket.tokens

    def first_token_rate(self, now: float) -> float | None:
        """First tokens per second while a queue drained, lately; None with too few to tell."""
        while self._firsts and self._firsts[0] < now - RATE_WINDOW_S:
            self._firsts.popleft()
        span = self._firsts[-1] - self._firsts[0] if self._firsts else 0.0
        if len(self._firsts) < MIN_RATE_SAMPLES or span <= 0:
            return None
        return (len(self._firsts) - 1) / span

    def _refuse(self, why: str, retry_after: float) -> None:
        self.refused += 1
        raise Overloaded(f"{why}; try again later", retry_after=min(MAX_RETRY_AFTER_S, max(1, math.ceil(retry_after))))


def tokens_memory_holds(available_bytes: int) -> int:
    """The default bound on prompt tokens in flight: ``MEMORY_SHARE`` of ``available_bytes``."""
    return max(1, int(available_bytes * MEMORY_SHARE) // QUEUED_TOKEN_BYTES)
