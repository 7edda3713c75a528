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


class Dashboard:
    def __init__(self, gateway: Gateway, metrics: ServeMetrics) -> None:
        self.gateway, self.metrics = gateway, metrics
        self.samples: deque[dict] = deque(maxlen=int(HISTORY_S / PERIOD_S))  # one a second, as the page draws it
        self.tokens: deque[tuple[float, float]] = deque(maxlen=int(HISTORY_S / PERIOD_S))  # (prompt, cached) then
        self._wire: tuple[float, dict[str, float]] | None = None  # (when, bytes by codec) at the last sample
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
        """One second of the gateway: the link, t and the rule, and per stage (STAGES) the requests there and
        how long one arriving now would wait."""
        scheduler, now = self.gateway.scheduler, time.time()
        signals = scheduler.last
        self._note_changes(now, asyncio.get_running_loop().time())
        ceiling = signals.link_rate_bps if signals is not None else scheduler.link_rate_bps
        wire = dict(self.metrics.link_wire_bytes)  # cumulative KV bytes on the wire, by codec
        then, old = self._wire if self._wire is not None else (now, {})
        self.samples.append({
            "at": round(now, 3),
            "egress_bps": signals.egress_bps if signals is not None else 0.0,
            "ceiling_bps": ceiling if ceiling < math.inf else None,  # None: unlimited or not measured; 0: cut
            "utilisation": round(scheduler.utilisation, 4),
            "threshold": scheduler.threshold,
            "rule": str(scheduler.rule),
            "depth": {stage: sum(w.requests for w in self.gateway.pool.of(c, r)) for stage, c, r, _ in STAGES},
            "wait_s": {stage: round(getattr(signals, f).wait_s, 4) if signals is not None else 0.0
                       for stage, _, _, f in STAGES},
            "wire_bps_by_codec": {c: 8 * (b - old.get(c, 0.0)) / (now - then) if now > then else 0.0
                                  for c, b in wire.items()},
        })  # fmt: skip
        self._wire = now, wire
        self.tokens.append((_total(self.metrics.prompt_tokens), _total(self.metrics.cached_tokens)))

    def _note_changes(self, wall: float, loop_now: float) -> None:
        """The short-term decisions since the last sample that moved t or changed the rule, with their reason."""
        history = getattr(self.gateway.scheduler.short, "history", ())  # a plugin policy may keep none
        for d in [d for d in history if d.at_s > self._seen_at]:  # decisions come in time order
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
        gw, link = self.gateway, self.gateway.link
        total_prompt, total_cached = _total(self.metrics.prompt_tokens), _total(self.metrics.cached_tokens)
        minute_ago = self.tokens[max(-60, -len(self.tokens))] if self.tokens else (total_prompt, total_cached)
        prompt, cached = total_prompt - minute_ago[0], total_cached - minute_ago[1]
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
                "samples": [j for j in self.samples if since is None or j["at"] > since],
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
