"""The live page of a running gateway: ``/dashboard`` (one HTML file) and the JSON it polls, ``/dashboard/state``.

    dashboard = Dashboard.install(app, gateway, metrics)   # routes, the sampler, the request ring

A sampler task owned by the app keeps a short history of what the scheduler saw each second; a ring holds the
records of the last requests. The state's fields: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import Counter

from minifaas.gateway.inter_cluster_link import NAME
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.requests import RequestRecord

if TYPE_CHECKING:
    from minifaas.gateway.gateway import Gateway
    from minifaas.gateway.worker_handle import WorkerHandle

log = logging.getLogger("minifaas.gateway")
HISTORY_S = 300  # seconds of link, threshold and queue samples kept
RECENT_REQUESTS = 50
PERIOD_S = 1.0
# /metrics' stage names, the workers that make each stage, and the scheduler's ``Signals`` field for it
STAGES = (
    ("prfaas_prefill", "prfaas", "prefill", "prfaas"),
    ("pd_prefill", "pd", "prefill", "pd_prefill"),
    ("decode", "pd", "decode", "decode"),
)


@dataclass(frozen=True, slots=True)
class Sample:
    """One second of the gateway as the page draws it."""

    at: float  # wall-clock seconds
    egress_bps: float
    ceiling_bps: float | None  # None: unlimited or not measured; 0: cut
    utilisation: float  # the short-term policy's smoothed reading
    threshold: int
    rule: str
    depth: dict[str, int]  # requests per stage (STAGES)
    wait_s: dict[str, float]  # how long a request arriving then would wait, per stage
    wire_bytes: dict[str, float]  # cumulative KV bytes on the wire, by codec
    prompt_tokens: float  # cumulative, for the prefix cache's hit rate
    cached_tokens: float

    def to_json(self, previous: Sample | None) -> dict:
        span = self.at - previous.at if previous is not None else 0.0
        old = previous.wire_bytes if previous is not None else {}
        by_codec = {c: 8 * (b - old.get(c, 0.0)) / span if span > 0 else 0.0 for c, b in self.wire_bytes.items()}
        return {
            "at": round(self.at, 3),
            "egress_bps": self.egress_bps,
            "ceiling_bps": self.ceiling_bps,
            "utilisation": round(self.utilisation, 4),
            "threshold": self.threshold,
            "rule": self.rule,
            "depth": self.depth,
            "wait_s": {k: round(v, 4) for k, v in self.wait_s.items()},
            "wire_bps_by_codec": by_codec,
        }


class Dashboard:
    def __init__(self, gateway: Gateway, metrics: ServeMetrics) -> None:
        self.gateway, self.metrics = gateway, metrics
        self.samples: deque[Sample] = deque(maxlen=int(HISTORY_S / PERIOD_S))
        self.sample_json: deque[dict] = deque(maxlen=int(HISTORY_S / PERIOD_S))  # each turned to JSON once
        self.requests: deque[tuple[float, str, RequestRecord]] = deque(maxlen=RECENT_REQUESTS)
        metrics.ended = self.requests  # the metrics append each routed request that ends
        self.changes: deque[dict] = deque(maxlen=200)  # the short-term scheduler's moves of t or the rule
        self._seen_at = -math.inf  # the newest scheduler decision already looked at
        self._rule = str(gateway.scheduler.rule)  # as configured, until the first decision
        self.page = resources.files("minifaas.gateway").joinpath("dashboard.html").read_bytes()

    @classmethod
    def install(cls, app: web.Application, gateway: Gateway, metrics: ServeMetrics) -> Dashboard:
        dashboard = cls(gateway, metrics)
        app.router.add_get("/dashboard", dashboard.page_handler)
        app.router.add_get("/dashboard/state", dashboard.state_handler)
        app.cleanup_ctx.append(dashboard._sampling)
        return dashboard

    async def _sampling(self, app: web.Application) -> AsyncIterator[None]:
        """The sampler lives as long as the app serves: started here, cancelled and awaited at cleanup."""
        task = asyncio.create_task(self.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # a sample that failed leaves a gap in the page, never the gateway down
                log.exception("the dashboard's sample failed")
            await asyncio.sleep(PERIOD_S)

    def sample(self) -> None:
        scheduler, now = self.gateway.scheduler, time.time()
        signals = scheduler.last
        self._note_changes(now, asyncio.get_running_loop().time())
        depth, wait = {}, {}
        for stage, cluster, role, field in STAGES:
            depth[stage] = sum(w.requests for w in self.gateway.pool.of(cluster, role))
            wait[stage] = getattr(signals, field).wait_s if signals is not None else 0.0
        ceiling = signals.link_rate_bps if signals is not None else scheduler.link_rate_bps
        previous = self.samples[-1] if self.samples else None
        self.samples.append(
            Sample(
                at=now,
                egress_bps=signals.egress_bps if signals is not None else 0.0,
                ceiling_bps=ceiling if ceiling < math.inf else None,
                utilisation=scheduler.utilisation,
                threshold=scheduler.threshold,
                rule=str(scheduler.rule),
                depth=depth,
                wait_s=wait,
                wire_bytes=dict(self.metrics.link_wire_bytes),
                prompt_tokens=_total(self.metrics.prompt_tokens),
                cached_tokens=_total(self.metrics.cached_tokens),
            )
        )
        self.sample_json.append(self.samples[-1].to_json(previous))

    def _note_changes(self, wall: float, loop_now: float) -> None:
        """The short-term decisions since the last sample that moved t or changed the rule, with their reason."""
        history = getattr(self.gateway.scheduler.short, "history", ())  # a plugin policy may keep none
        fresh = []
        for decision in reversed(history):
            if decision.at_s <= self._seen_at:
                break
            fresh.append(decision)
        for d in reversed(fresh):
            rule = str(d.rule)
            if d.threshold != d.previous or rule != self._rule:
                self.changes.append({
                    "at": round(wall - (loop_now - d.at_s), 3), "action": str(d.action), "reason": str(d.reason),
                    "from": d.previous, "to": d.threshold, "rule_from": self._rule, "rule": rule,
                    "utilisation": round(d.utilisation, 4),
                })  # fmt: skip
            self._rule, self._seen_at = rule, d.at_s

    def state(self, since: float | None = None) -> dict:
        """The page's figures; ``since``: only the samples taken after that time (the page holds the rest)."""
        gw, samples = self.gateway, list(self.samples)
        link = gw.link
        total_prompt, total_cached = _total(self.metrics.prompt_tokens), _total(self.metrics.cached_tokens)
        minute_ago = samples[-60] if len(samples) >= 60 else samples[0] if samples else None
        prompt = total_prompt - minute_ago.prompt_tokens if minute_ago is not None else 0.0
        cached = total_cached - minute_ago.cached_tokens if minute_ago is not None else 0.0
        return {
            "now": time.time(),
            "period_s": PERIOD_S,
            "history_s": HISTORY_S,
            "model": gw.model_name,
            "link": {
                "name": NAME,
                "emulated": link.emulated,
                "up": link.up,
                "down": dict(link.down),
                "configured_rate": gw.config.link.rate,
                "wire_bytes_by_codec": dict(self.metrics.link_wire_bytes),
                "samples": [j for j in self.sample_json if since is None or j["at"] > since],
            },
            "scheduler": {
                "threshold": gw.scheduler.threshold,
                "rule": str(gw.scheduler.rule),
                "fixed": gw.config.fixed_threshold,
                "changes": list(self.changes),
            },
            "clusters": {cluster: self._cluster(cluster) for cluster in ("prfaas", "pd")},
            "requests": [
                {"finished_at": round(at, 3), "outcome": outcome, **record.to_json()}
                for at, outcome, record in reversed(self.requests)
            ],
            "prefix_cache": {
                "prompt_tokens": total_prompt,
                "cached_tokens": total_cached,
                "hit_rate": total_cached / total_prompt if total_prompt else 0.0,
                "recent_hit_rate": cached / prompt if prompt else None,  # over the last minute of samples
            },
            "inflight": gw.admission.requests,
        }

    def _cluster(self, cluster: str) -> dict:
        gw = self.gateway
        workers = [w for w in gw.pool.workers.values() if w.cluster == cluster]
        out: dict = {"workers": [_worker(w) for w in sorted(workers, key=lambda w: (w.role, w.name))]}
        if cluster == "pd":
            out["split"] = {"prefill": len(gw.pool.of("pd", "prefill")), "decode": len(gw.pool.of("pd", "decode"))}
            out["role_changes_in_progress"] = len(gw.roles.tasks)
            out["role_changes"] = dict(gw.roles.counts)
        return out

    async def page_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.page, content_type="text/html", charset="utf-8")

    async def state_handler(self, request: web.Request) -> web.Response:
        since = request.query.get("since")
        try:
            after = float(since) if since is not None else None
            if after is not None and math.isnan(after):  # no sample is after NaN: the page would stop moving
                raise ValueError(since)
        except ValueError:
            raise web.HTTPBadRequest(reason=f"since must be a time in seconds, got {since!r}") from None
        return web.json_response(self.state(after), headers={"Cache-Control": "no-store"})


def _worker(w: WorkerHandle) -> dict:
    state = "restarting" if not w.alive else "changing role" if w.draining else "up"
    return {
        "name": w.name,
        "role": w.role,
        "state": state,
        "requests": w.requests,
        "load_tokens": w.load_tokens,
        "restarts": w.rejoins,
        "kernels": w.kernels,
    }


def _total(counter: Counter) -> float:
    """A counter's ``_total`` samples over every label, summed, as /metrics shows them."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
