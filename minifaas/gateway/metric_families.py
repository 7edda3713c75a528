"""The Prometheus families the server exports, named as vLLM users already scrape them (``minifaas:`` for ``vllm:``).

``MetricFamilies`` creates them, in the order they are exposed, and sets the gauges the gateway samples (queues,
links, processes, the threshold); ``ServeMetrics`` (``gateway.metrics``) adds what each request does.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Bucket edges follow vLLM's, so existing dashboards read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)

# Outcomes of requests_total: "stop" / "length" (finished), "abort" (client went away),
# "invalid" (rejected with a 4xx), "overloaded" (503), "error" (500 or 504).
# Causes of request_errors_total: the error body's code (invalid_request, invalid_api_key, model_not_found,
# context_length_exceeded, request_too_large, body_timeout, not_found, method_not_allowed, overloaded,
# too_many_connections, request_failed, timeout, internal_error), so every error a client got is counted.
ROUTES = ("prfaas", "local")


class MetricFamilies:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = r = registry  # the families are created, and exposed, in this order
        self._requests(r)
        self._latencies(r)
        self._tokens(r)
        self._links(r)
        self._scheduling(r)
        self._coding(r)
        self._processes(r)
        for route in ROUTES:  # known label values are exported from the start, so dashboards see zeros, not gaps
            for histogram in (self.ttft, self.tpot, self.e2e, self.queue_time, self.transfer_time):
                histogram.labels(route=route)

    def _requests(self, r: CollectorRegistry) -> None:
        # Requests that ended, by route (prfaas, local, none) and outcome.
        self.requests = Counter("minifaas:requests", "Requests that ended", ["route", "outcome"], registry=r)
        # Error answers (HTTP status >= 400, or an error event in a stream), by cause.
        self.request_errors = Counter("minifaas:request_errors", "Errors returned to clients", ["cause"], registry=r)
        # Open HTTP client connections (the server answers 503 beyond its max_connections).
        self.connections = Gauge("minifaas:http_connections", "Open HTTP client connections", registry=r)
        # Requests between arrival and their last byte.
        self.running = Gauge("minifaas:num_requests_running", "Requests in flight in the HTTP layer", registry=r)

    def _latencies(self, r: CollectorRegistry) -> None:
        # Arrival to first token, as the client sees it.
        self.ttft = Histogram(
            "minifaas:time_to_first_token_seconds", "Time to first token", ["route"], buckets=TTFT_BUCKETS, registry=r
        )
        # Mean gap between output tokens after the first, per request.
        self.tpot = Histogram(
            "minifaas:time_per_output_token_seconds", "Time per token", ["route"], buckets=TPOT_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "minifaas:e2e_request_latency_seconds", "End-to-end latency", ["route"], buckets=E2E_BUCKETS, registry=r
        )
        # Time a request waited before its prefill started.
        self.queue_time = Histogram(
            "minifaas:request_queue_time_seconds", "Queue time", ["route"], buckets=E2E_BUCKETS, registry=r
        )
        # Time the layer states took to reach the decode worker once prefill was done.
        self.transfer_time = Histogram(
            "minifaas:kv_transfer_seconds", "KV transfer tail time", ["route"], buckets=TTFT_BUCKETS, registry=r
        )

    def _tokens(self, r: CollectorRegistry) -> None:
        # Prompt tokens of finished or aborted requests.
        self.prompt_tokens = Counter("minifaas:prompt_tokens", "Prompt tokens processed", registry=r)
        # Prompt tokens served from the prefix cache instead of prefilled.
        self.cached_tokens = Counter("minifaas:prompt_tokens_cached", "Prompt tokens found in cache", registry=r)
        self.generation_tokens = Counter("minifaas:generation_tokens", "Generation tokens produced", registry=r)
        # Requests whose decode worker went away: moved to another (re-prefilled), or refused past the limit.
        self.migrations = Counter(
            "minifaas:migrations", "Requests that lost their decode worker: moved, or refused", ["outcome"], registry=r
        )
        # Requests re-prefilled locally because their PrfaaS path failed, by reason.
        self.fallbacks = Counter("minifaas:fallbacks", "PrfaaS requests that fell back", ["reason"], registry=r)

    def _links(self, r: CollectorRegistry) -> None:
        # Layer-state bytes sent over each link, as the state's size before any codec (counted by the gateway,
        # partial transfers included), and the bytes those transfers put on the wire, by the codec that coded them.
        self.kv_bytes_sent = Counter(
            "minifaas:kv_bytes_sent", "KV state bytes sent, before coding", ["link"], registry=r
        )
        self.kv_wire_bytes_sent = Counter(
            "minifaas:kv_wire_bytes_sent", "KV bytes put on the wire, after coding", ["link", "codec"], registry=r
        )
        # Fraction of each link's bandwidth in use, 0..1.
        self.link_utilization = Gauge("minifaas:link_utilization", "Link utilisation", ["link"], registry=r)
        # Over a real link, the KV connections' smoothed rtt and the share of bytes retransmitted (0 when emulated).
        self.link_rtt = Gauge("minifaas:link_rtt_seconds", "Smoothed rtt of the KV connections", ["link"], registry=r)
        self.link_retransmits = Gauge(
            "minifaas:link_retransmit_ratio", "Retransmitted over sent KV bytes", ["link"], registry=r
        )
        # Requests waiting at each stage (e.g. prfaas_prefill, pd_prefill, decode).
        self.queue_depth = Gauge("minifaas:queue_depth", "Requests waiting per stage", ["stage"], registry=r)

    def _scheduling(self, r: CollectorRegistry) -> None:
        # The scheduler's decisions, by policy, action (raise, lower, hold) and reason.
        self.scheduler_decisions = Counter(
            "minifaas:scheduler_decisions", "Scheduler decisions", ["policy", "action", "reason"], registry=r
        )
        # PD workers that changed role (to prefill or decode), and conversions that did not happen and why.
        self.role_changes = Counter("minifaas:role_changes", "PD role conversions", ["to", "outcome"], registry=r)
        # Prefills stopped early because their request was aborted (client left, or timed out), by cluster,
        # and the prompt tokens they were spared.
        self.prefills_stopped = Counter("minifaas:prefills_stopped", "Prefills stopped early", ["cluster"], registry=r)
        self.prefill_tokens_spared = Counter(
            "minifaas:prefill_tokens_spared", "Prompt tokens not prefilled after an abort", ["cluster"], registry=r
        )

    def _coding(self, r: CollectorRegistry) -> None:
        # The codec chosen for each KV transfer across the link, and why (policy.codec_policy).
        self.kv_codec_choices = Counter(
            "minifaas:kv_codec_choices", "Codec chosen per KV transfer", ["codec", "reason"], registry=r
        )
        # State bytes of coded transfers before coding, the bytes on the wire after, and the time spent
        # coding (side "encode", at the prefill worker) and decoding (side "decode", at the receiver).
        self.kv_codec_state_bytes = Counter(
            "minifaas:kv_codec_state_bytes", "KV state bytes before coding", ["codec"], registry=r
        )
        self.kv_codec_wire_bytes = Counter(
            "minifaas:kv_codec_wire_bytes", "KV bytes on the wire after coding", ["codec"], registry=r
        )
        self.kv_codec_seconds = Counter("minifaas:kv_codec_seconds", "KV coding time", ["codec", "side"], registry=r)
        # The link rate (bits/s) a transfer must get less of for lossless coding to save time (0: unmeasured).
        self.kv_codec_break_even = Gauge(
            "minifaas:kv_codec_break_even_bits_per_second", "Break-even link rate of lossless coding", registry=r
        )

    def _processes(self, r: CollectorRegistry) -> None:
        # Every process the gateway supervises (workers by name, link emulators by link): 1 in service, 0 down;
        # and how many times each came back after it was lost.
        self.process_up = Gauge("minifaas:process_up", "Supervised process in service", ["process"], registry=r)
        self.process_restarts = Gauge(
            "minifaas:process_restarts", "Times a supervised process came back", ["process"], registry=r
        )
        # 1 for each worker's kernels: fla, torch (the reference kernels) or none (a model without linear layers).
        self._kernels_of: dict[str, str] = {}
        self.kernels = Gauge(
            "minifaas:worker_kernels", "Kernels a worker's model runs", ["worker", "kernels"], registry=r
        )
        # The offload threshold in force: incremental prompt tokens above which PrfaaS prefills.
        self.threshold = Gauge("minifaas:offload_threshold_tokens", "Offload threshold", registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def set_queue_depth(self, stage: str, depth: int) -> None:
        self.queue_depth.labels(stage=stage).set(depth)

    def set_link_health(self, link: str, utilisation: float, rtt_ms: float, retrans_rate: float) -> None:
        self.link_utilization.labels(link=link).set(utilisation)
        self.link_rtt.labels(link=link).set(rtt_ms / 1000)
        self.link_retransmits.labels(link=link).set(retrans_rate)

    def set_process(self, name: str, up: bool, restarts: int) -> None:
        self.process_up.labels(process=name).set(1 if up else 0)
        self.process_restarts.labels(process=name).set(restarts)

    def scheduler_decision(self, policy: str, action: str, reason: str) -> None:
        self.scheduler_decisions.labels(policy=policy, action=action, reason=reason).inc()

    def role_change(self, to: str, outcome: str) -> None:
        self.role_changes.labels(to=to, outcome=outcome).inc()

    def worker_kernels(self, worker: str, kernels: str) -> None:
        """One series per worker: a worker restarted (a role change) replaces its old one."""
        old = self._kernels_of.pop(worker, None)
        if old is not None:
            self.kernels.remove(worker, old)
        self._kernels_of[worker] = kernels
        self.kernels.labels(worker=worker, kernels=kernels).set(1)

    def set_threshold(self, tokens: int) -> None:
        self.threshold.set(tokens)
