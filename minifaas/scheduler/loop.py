"""The scheduler in the live gateway: the gateway's state turned into ``Signals`` once per sampling tick.

The gateway already samples its link emulators and worker queues every second
(``Gateway._watch_links``); at the end of each pass it calls ``tick``, which
steps the short-term policy and writes its threshold and rule back into the
gateway, where the next ``_route`` reads them. Every decision is logged by
the policy and counted in /metrics here.

What the live signals hold: PrfaaS egress and the link ceiling summed over the
emulators in front of the decode workers (their interval byte counters and
current rates); queue depth per stage from the requests open on each worker;
the incremental lengths the router placed. Not measured live (left at 0, so
the rules that use them stay quiet): per-stage waiting time, the link backlog
(the KV senders live in the prefill workers), rtt and retransmissions (the
relay ends every connection on loopback; netns mode would give real ones).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from minifaas.policy.router import RouteDecision
from minifaas.scheduler.short_term import Action, ShortTermConfig, ShortTermPolicy
from minifaas.scheduler.signals import Signals, StageLoad

if TYPE_CHECKING:
    from minifaas.serve.gateway import Gateway


class LiveScheduler:
    def __init__(self, gateway: Gateway, config: ShortTermConfig) -> None:
        self.gateway = gateway
        self.short = ShortTermPolicy(config, gateway.threshold, gateway.rule)
        self.lengths: list[int] = []
        self.egress_since: dict[str, float] = {}  # emulator -> its uptime at the reading last used
        gateway.metrics.set_threshold(gateway.threshold)

    def observe(self, decision: RouteDecision) -> None:
        """A request was routed: remember how much of it had to be prefilled."""
        self.lengths.append(decision.incremental_tokens)

    def signals(self, now: float) -> Signals:
        egress = rate = 0.0
        for name, stats in self.gateway.link_stats.items():
            fresh = stats.get("uptime_s", 0.0) != self.egress_since.get(name)
            self.egress_since[name] = stats.get("uptime_s", 0.0)
            if fresh and stats.get("interval_s"):
                egress += 8 * stats["interval_up_bytes"] / stats["interval_s"]
            rate += stats["rate_bps"] if stats.get("rate_bps") is not None else math.inf
        lengths, self.lengths = tuple(self.lengths), []
        return Signals(
            now_s=now,
            link_rate_bps=rate if self.gateway.link_stats else math.inf,
            egress_bps=egress,
            prfaas=self._stage("prfaas", "prefill"),
            pd_prefill=self._stage("pd", "prefill"),
            decode=self._stage("pd", "decode"),
            lengths=lengths,
        )

    def tick(self, now: float) -> None:
        gw = self.gateway
        decision = self.short.step(self.signals(now))
        gw.threshold, gw.rule = decision.threshold, decision.rule
        gw.metrics.scheduler_decision("short_term", decision.action, decision.reason)
        if decision.action is not Action.HOLD:
            gw.metrics.set_threshold(decision.threshold)

    def _stage(self, cluster: str, role: str) -> StageLoad:
        workers = [w for w in self.gateway.workers.values() if w.cluster == cluster and w.role == role]
        return StageLoad(sum(w.alive for w in workers), sum(len(w.inboxes) for w in workers))
