"""What each request adds to the server's Prometheus metrics (the families are ``metric_families``).

Each ServeMetrics owns its registry, so servers (or tests) in one process never share a series.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry

from minifaas.gateway.metric_families import MetricFamilies
from minifaas.gateway.requests import RequestRecord

NO_ROUTE = "none"  # the route label of a request rejected before it was routed


class ServeMetrics(MetricFamilies):
    """The families, and what requests, their transfers and their connections add to them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry if registry is not None else CollectorRegistry())
        self.link_wire_bytes: dict[str, float] = {}  # by codec, the bytes PrfaaS's transfers put on the link
        self.ended: deque[tuple[float, str, RequestRecord]] | None = None  # the last routed requests, if kept

    def request_finished(self, record: RequestRecord | None, outcome: str) -> None:
        """Count one request that ended; ``record`` is None when it was rejected before reaching the gateway."""
        route = (record.route if record is not None else None) or NO_ROUTE
        self.requests.labels(route=route, outcome=outcome).inc()
        if record is None:
            return
        if self.ended is not None:
            self.ended.append((time.time(), outcome, record))
        self.prompt_tokens.inc(record.prompt_tokens)
        self.cached_tokens.inc(record.cached_tokens)
        self.generation_tokens.inc(record.completion_tokens)
        if record.fallback:
            self.fallbacks.labels(reason=record.fallback).inc()
        if record.queue_s is not None:
            self.queue_time.labels(route=route).observe(record.queue_s)
        if record.transfer_s is not None:
            self.transfer_time.labels(route=route).observe(record.transfer_s)
        if record.ttft_s is None or record.completion_tokens == 0:
            return
        self.ttft.labels(route=route).observe(record.ttft_s)
        if record.e2e_s is not None:
            self.e2e.labels(route=route).observe(record.e2e_s)
            if record.completion_tokens > 1:
                tpot = (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)
                self.tpot.labels(route=route).observe(max(tpot, 0.0))

    def request_error(self, cause: str) -> None:
        self.request_errors.labels(cause=cause).inc()

    def migration(self, outcome: str) -> None:
        self.migrations.labels(outcome).inc()

    def add_kv_bytes(self, link: str, nbytes: int, wire_bytes: int | None = None, codec: str = "none") -> None:
        """A transfer of ``nbytes`` of state over ``link``, ``wire_bytes`` on the wire (None: as many, uncoded)."""
        self.kv_bytes_sent.labels(link=link).inc(nbytes)
        wire = nbytes if wire_bytes is None else wire_bytes
        self.kv_wire_bytes_sent.labels(link=link, codec=codec).inc(wire)
        if link.startswith("prfaas->"):  # PrfaaS's transfers cross the link; PD's (``pd->...``) stay in the cluster
            self.link_wire_bytes[codec] = self.link_wire_bytes.get(codec, 0.0) + wire

    def codec_chosen(self, codec: str, reason: str, break_even_bytes_per_s: float) -> None:
        self.kv_codec_choices.labels(codec=codec, reason=reason).inc()
        self.kv_codec_break_even.set(8 * break_even_bytes_per_s)

    def kv_coded(self, codec: str, nbytes: int, wire_bytes: int, encode_s: float, decode_s: float) -> None:
        self.kv_codec_state_bytes.labels(codec=codec).inc(nbytes)
        self.kv_codec_wire_bytes.labels(codec=codec).inc(wire_bytes)
        self.kv_codec_seconds.labels(codec=codec, side="encode").inc(encode_s)
        self.kv_codec_seconds.labels(codec=codec, side="decode").inc(decode_s)

    def prefill_stopped(self, cluster: str, tokens: int, done_tokens: int) -> None:
        self.prefills_stopped.labels(cluster=cluster).inc()
        self.prefill_tokens_spared.labels(cluster=cluster).inc(max(tokens - done_tokens, 0))
