"""The scheduler in the simulator: the live policies fed from the simulated pools, their decisions applied.

Each tick turns the pools and the link into one ``Signals``. A role conversion retires the least-loaded worker
of the shrinking role, waits until it holds nothing, then adds a worker to the other role ``convert_s`` later.
"""

from __future__ import annotations

import numpy as np

from minifaas.planner.case import PlanCase
from minifaas.planner.lengths import LengthDistribution
from minifaas.policy.interfaces import LongTermControl, ShortTermControl
from minifaas.policy.long_term import LongTermPolicy
from minifaas.policy.plugin import LONG_TERM, SHORT_TERM, building, load_policy
from minifaas.policy.short_term import ShortTermPolicy
from minifaas.policy.signals import Signals, StageLoad
from minifaas.sim.decode import DecodeInstances
from minifaas.sim.deployment import SimConfig
from minifaas.sim.engine import EventLoop
from minifaas.sim.fluid_link import FluidLink
from minifaas.sim.prefill import PrefillInstances
from minifaas.sim.workload import Workload


class SimScheduler:
    def __init__(
        self,
        config: SimConfig,
        workload: Workload,
        loop: EventLoop,
        link: FluidLink,
        prfaas: PrefillInstances,
        pd: PrefillInstances,
        decode: DecodeInstances,
    ) -> None:
        self.config, self.loop, self.link = config, loop, link
        self.prfaas, self.pd, self.decode = prfaas, pd, decode
        self.threshold, self.rule = config.threshold, config.rule
        self.utilisation = 0.0  # the short-term policy's smoothed reading of the link, as of its last step
        self.short: ShortTermControl | None = None
        if config.short_term is not None:
            offered = dict(config=config.short_term, threshold=config.threshold, rule=config.rule)
            with building(SHORT_TERM, config.short_term_policy):
                self.short = (
                    ShortTermPolicy(**(offered | dict(config.short_term_args))) if config.short_term_policy == "default"
                    else load_policy(config.short_term_policy, SHORT_TERM, config.short_term_args, **offered)
                )  # fmt: skip
        self.long: LongTermControl | None = None
        if config.long_term is not None:
            offered = dict(config=config.long_term, case=_case_of(config, workload), threshold=config.threshold,
                           n_prefill=config.n_prefill, n_decode=config.n_decode)  # fmt: skip
            with building(LONG_TERM, config.long_term_policy):
                self.long = (
                    LongTermPolicy(**(offered | dict(config.long_term_args))) if config.long_term_policy == "default"
                    else load_policy(config.long_term_policy, LONG_TERM, config.long_term_args, **offered)
                )  # fmt: skip
        self.conversions = 0  # workers that finished changing role
        self.lengths: list[int] = []  # incremental prefill lengths routed since the last tick
        self.trace: list[tuple[float, int, int, int]] = []  # (time, t, PD-P serving, PD-D serving)
        self._sent = 0.0
        self._last = 0.0
        self._serial = 0
        self._draining_decode: set[int] = set()

    @property
    def active(self) -> bool:
        return self.short is not None or self.long is not None

    def tick(self) -> None:
        if not self.active:
            return
        now = self.loop.now
        self.link.advance(now)
        sent, elapsed = self.link.sent_bytes - self._sent, now - self._last
        self._sent, self._last = self.link.sent_bytes, now
        d = self.decode
        signals = Signals(
            now_s=now,
            link_rate_bps=self.link.bytes_per_s * 8,
            egress_bps=8 * sent / elapsed if elapsed > 0 else 0.0,
            prfaas=StageLoad(self.prfaas.serving, self.prfaas.in_system, self.prfaas.wait_s(now)),
            pd_prefill=StageLoad(self.pd.serving, self.pd.in_system, self.pd.wait_s(now)),
            decode=StageLoad(d.serving, d.total_running + d.total_waiting),
            rtt_ms=0.0,  # the fluid link has a fixed rtt: nothing to learn from it
            link_backlog_s=self.link.backlog_bytes() / self.link.bytes_per_s if self.link.bytes_per_s else 0.0,
            decode_occupancy=d.total_running / max(1, d.serving * d.profile.bs_max),
            lengths=tuple(self.lengths),
        )
        self.lengths.clear()
        if self.short is not None:
            decision = self.short.step(signals)
            self.threshold, self.rule, self.utilisation = decision.threshold, decision.rule, decision.utilisation
        if self.long is not None:
            plan = self.long.step(signals)
            if plan is not None:
                if self.short is not None:
                    self.threshold = self.short.set_base(plan.threshold)
                for _ in range(abs(plan.to_prefill)):
                    self._convert(to_prefill=plan.to_prefill > 0)
        self.trace.append((now, self.threshold, self.pd.serving, self.decode.serving))

    def _convert(self, to_prefill: bool) -> None:
        if to_prefill:
            candidates = [i for i in range(len(self.decode)) if i not in self.decode.retired]
            if len(candidates) <= 1:
                return
            node = min(candidates, key=lambda i: self.decode.assigned[i])
            if self.decode.retire(node):
                self.drained(into_prefill=True)
            else:
                self._draining_decode.add(node)
        else:
            candidates = [i for i in range(len(self.pd)) if i not in self.pd.retired]
            if not candidates:
                return
            node = min(candidates, key=lambda i: self.pd.queued_tokens[i])
            self.pd.retire(node)
            if not self.pd.in_node[node]:
                self.drained(into_prefill=False)

    def decode_finished(self, node: int) -> None:
        """Called when a decode ends on ``node``: a retired worker that is now empty converts."""
        if node in self._draining_decode and not self.decode.assigned[node]:
            self._draining_decode.discard(node)
            self.drained(into_prefill=True)

    def drained(self, into_prefill: bool) -> None:
        self.loop.at(self.loop.now + self.config.convert_s, self._rejoin, into_prefill)

    def _rejoin(self, into_prefill: bool) -> None:
        self._serial += 1
        if into_prefill:
            self.pd.add_node(f"pd-p-c{self._serial}", self.loop.now)
        else:
            self.decode.add_node(f"pd-d-c{self._serial}")
        self.conversions += 1


def _case_of(config: SimConfig, workload: Workload) -> PlanCase:
    n_pd = config.n_prefill + config.n_decode
    return PlanCase(
        name="simulated",
        prfaas=config.prfaas,
        pd_prefill=config.pd_prefill,
        decode=config.decode,
        lengths=LengthDistribution.empirical("workload", workload.input_tokens[:1000]),
        output_tokens=float(np.mean(workload.output_tokens)) if len(workload) else 1.0,
        n_prfaas=config.n_prfaas,
        n_pd=n_pd,
        n_homogeneous=max(2, n_pd),
        link_gbps=config.link.gbps if config.link.gbps > 0 else 1.0,
    )
