"""Admission (sans-IO): a queue of thousands by default, bounded by count, by memory and by the first-token deadline.

The gateway's own use of it, from real workers, is in test_gateway_deadlines; the 503 it becomes, with its
Retry-After and error body, in test_api_errors; a thousand concurrent streams all served in bench_scale.
"""

from __future__ import annotations

import pytest

from minifaas.config import ServeConfig
from minifaas.gateway.requests import (
    MIN_RATE_SAMPLES,
    QUEUED_TOKEN_BYTES,
    RATE_WINDOW_S,
    Admission,
    Overloaded,
    tokens_memory_holds,
)


def test_the_default_queue_holds_thousands_bounded_by_memory_not_a_small_count() -> None:
    config = ServeConfig()
    assert config.max_queued_requests >= 4096
    assert config.max_queued_tokens == 0  # sized by memory when the gateway starts
    assert tokens_memory_holds(16 << 30) == (4 << 30) // QUEUED_TOKEN_BYTES  # a quarter of 16 GiB
    admission = Admission(config.max_queued_requests, tokens_memory_holds(16 << 30), config.first_token_timeout)
    tickets = [admission.admit(64, now=0.0) for _ in range(4096)]  # all at once: no rate known yet
    assert admission.requests == 4096 and admission.waiting == 4096
    with pytest.raises(Overloaded, match="4096 requests in flight"):
        admission.admit(64, now=0.0)
    for ticket in tickets:
        admission.release(ticket)
    assert (admission.requests, admission.tokens, admission.waiting) == (0, 0, 0)


def test_prompt_tokens_in_flight_are_bounded_but_a_lone_prompt_past_the_bound_still_runs() -> None:
    admission = Admission(max_requests=0, max_tokens=1000, first_token_timeout=300.0)
    big = admission.admit(5000, now=0.0)  # alone: it could never run otherwise
    with pytest.raises(Overloaded, match="prompt tokens in flight") as refused:
        admission.admit(10, now=0.0)
    assert refused.value.retry_after == 1
    admission.release(big)
    small = [admission.admit(400, now=0.0) for _ in range(2)]
    with pytest.raises(Overloaded):
        admission.admit(400, now=0.0)
    admission.release(small[0])
    admission.admit(400, now=0.0)
    assert admission.refused == 2


def test_a_request_whose_first_token_would_come_past_its_deadline_is_told_to_retry_now() -> None:
    admission = Admission(max_requests=0, max_tokens=0, first_token_timeout=10.0)
    burst = [admission.admit(8, now=0.0) for _ in range(3 * MIN_RATE_SAMPLES)]
    for i, ticket in enumerate(burst[: 2 * MIN_RATE_SAMPLES]):  # the queue drains at 2 first tokens a second
        admission.first_token(ticket, now=0.5 * i)
        admission.first_token(ticket, now=0.5 * i + 0.1)  # once per request
    now = 0.5 * (2 * MIN_RATE_SAMPLES - 1)
    assert admission.first_token_rate(now) == pytest.approx(2.0)
    waiting = admission.waiting
    queued = [admission.admit(8, now) for _ in range(int(10.0 * 2.0) - waiting)]  # each first token within 10 s
    with pytest.raises(Overloaded, match="first-token deadline") as refused:
        admission.admit(8, now)
    assert 1 <= refused.value.retry_after <= 60
    admission.first_token(queued[0], now + 0.5)  # one less ahead of it
    admission.admit(8, now + 0.5)
    assert admission.first_token_rate(now + RATE_WINDOW_S + 1) is None  # an old rate is forgotten
    admission.admit(8, now + RATE_WINDOW_S + 1)  # and with no rate known the deadline bound waits for one


def test_first_tokens_after_an_idle_spell_do_not_read_as_a_slow_queue() -> None:
    admission = Admission(max_requests=0, max_tokens=0, first_token_timeout=10.0)
    for i in range(4 * MIN_RATE_SAMPLES):  # one request at a time, a minute apart: nothing ever waited
        admission.first_token(admission.admit(8, now=60.0 * i), now=60.0 * i + 0.5)
    assert admission.first_token_rate(now=60.0 * 4 * MIN_RATE_SAMPLES) is None
    crowd = [admission.admit(8, now=1e4) for _ in range(1000)]  # a thousand at once: all taken
    assert admission.waiting == len(crowd)
