"""Admission: which requests the gateway takes in, bounded by count, by memory and by the first-token deadline.

Past a bound a request is refused at once with ``Overloaded`` (HTTP 503 with Retry-After); within them it waits
its turn. Sans-IO: the gateway passes the clock in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from minifaas.config import ServeConfig
from minifaas.gateway.requests import Overloaded
from minifaas.model.host_memory import available_bytes

QUEUED_TOKEN_BYTES = 64  # what the gateway holds per prompt token in flight: its id, its share of the body and keys
MEMORY_SHARE = 0.25  # of the host memory available at start, the most the prompts in flight may take
RATE_SAMPLES = 64  # the latest first tokens that came while others waited: the rate is taken over them
MIN_RATE_SAMPLES = 16  # fewer: no rate known, the deadline bound is off
RATE_WINDOW_S = 60.0  # older ones are forgotten
MAX_RETRY_AFTER_S = 60


@dataclass(slots=True)
class Ticket:
    """One admitted request: what it holds of the bounds, and whether its first token has come."""

    tokens: int
    waiting: bool = True


@dataclass(slots=True)
class Admission:
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
