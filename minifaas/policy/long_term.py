"""The long-term policy (minutes): re-profile the traffic, re-solve the planner, re-role PD workers.

Once a period, or at once when the link's ceiling moves, ``step`` plans (t, N_p, N_d) for the traffic the ticks
saw. The new t becomes the short-term base; the split changes only when the plan beats the current one by
``min_gain``, by at most ``max_conversions`` workers a period, which the caller drains and reports through
``converted``. PrfaaS instances never change role: they are another cluster, on other hardware.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from minifaas.planner.case import PlanCase
from minifaas.planner.lengths import LengthDistribution
from minifaas.planner.model import stages
from minifaas.planner.profile import PrefillProfile
from minifaas.planner.search import SearchGrid, best_prfaas
from minifaas.policy.signals import Signals

log = logging.getLogger("minifaas.policy")


class RebalanceReason(StrEnum):
    OFF = "off"  # rebalancing disabled
    CONVERT = "convert"  # the split changes by ``to_prefill`` workers
    RETUNE = "retune"  # same split, new t
    KEEP = "keep"  # neither split nor t changed
    SMALL_GAIN = "small_gain"  # a better split exists, but not by min_gain
    FEW_REQUESTS = "few_requests"
    CONVERTING = "converting"  # a conversion is still draining
    LINK_DOWN = "link_down"


@dataclass(frozen=True, slots=True)
class LongTermConfig:
    enabled: bool = True  # off: no re-planning, no role conversion
    period_s: float = 300.0
    min_requests: int = 200
    min_gain: float = 0.05
    max_conversions: int = 1
    threshold_step: int = 100  # the planner's grid over t
    link_change: float = 0.2  # re-plan at once when the link's ceiling moves by more than this; 0: never

    def __post_init__(self) -> None:
        if self.period_s <= 0 or self.min_requests < 1 or self.min_gain < 0:
            raise ValueError("need period_s > 0, min_requests >= 1, min_gain >= 0")
        if self.max_conversions < 1 or self.threshold_step < 1 or self.link_change < 0:
            raise ValueError("need max_conversions >= 1, threshold_step >= 1, link_change >= 0")


@dataclass(frozen=True, slots=True)
class RebalanceDecision:
    at_s: float
    reason: RebalanceReason
    threshold: int  # the planner's t for the traffic of the period (the current base when not re-planned)
    n_prefill: int  # PD-P workers once this decision is carried out
    n_decode: int
    to_prefill: int = 0  # workers to move decode -> prefill (negative: prefill -> decode)
    planned_rps: float = 0.0  # Lambda_max at the planned (t, N_p, N_d)
    current_rps: float = 0.0  # Lambda_max of the current split, same traffic
    rate_rps: float = 0.0  # arrivals measured over the period
    mean_length: float = 0.0


@dataclass
class LongTermPolicy:
    """Sans-IO: ``step`` on every tick (it acts once a period); ``observe_prefill`` as prefills end."""

    config: LongTermConfig
    case: PlanCase  # hardware, link and output length; its lengths are replaced by what is measured
    threshold: int
    n_prefill: int
    n_decode: int
    reasons: Counter[RebalanceReason] = field(default_factory=Counter, init=False)
    decisions: list[RebalanceDecision] = field(default_factory=list, init=False)
    _lengths: list[int] = field(default_factory=list, init=False)
    _period_start: float = field(default=0.0, init=False)
    _link_bps: float = field(default=0.0, init=False)
    _planned_link_bps: float | None = field(default=None, init=False)  # the link ceiling the last plan was made for
    _previous: list[int] = field(default_factory=list, init=False)  # the last plan's lengths
    _measured: dict[str, list[float]] = field(default_factory=dict, init=False)  # cluster -> [measured s, profiled s]
    _outputs: list[int] = field(default_factory=list, init=False)  # completion tokens of the period's finished requests

    def __post_init__(self) -> None:
        # the arguments may come from flags, each any JSON value
        for name, kind in (("config", LongTermConfig), ("case", PlanCase), ("threshold", int), ("n_prefill", int),
                           ("n_decode", int)):  # fmt: skip
            if not isinstance(getattr(self, name), kind) or type(getattr(self, name)) is bool:
                what = "an integer" if kind is int else f"a {kind.__name__}"
                raise TypeError(f"{name} must be {what}, got {getattr(self, name)!r}")
        if self.n_prefill + self.n_decode != self.case.n_pd:
            raise ValueError("n_prefill + n_decode must equal the case's n_pd")

    def observe_prefill(self, cluster: str, tokens: int, seconds: float) -> None:
        """One prefill's measured time on ``cluster`` ("prfaas" or "pd"): instance speed vs the profile."""
        profile = self.case.prfaas if cluster == "prfaas" else self.case.pd_prefill
        sums = self._measured.setdefault(cluster, [0.0, 0.0])
        sums[0] += seconds
        sums[1] += float(profile.latency_s(max(tokens, 1)))

    def converted(self, decision: RebalanceDecision, ok: bool) -> None:
        """One worker ``decision`` moved has changed role (``ok``), or kept its own: its move is taken back."""
        if ok or not decision.to_prefill:
            return
        step = 1 if decision.to_prefill > 0 else -1
        self.n_prefill, self.n_decode = self.n_prefill - step, self.n_decode + step

    def step(self, s: Signals) -> RebalanceDecision | None:
        self._lengths.extend(s.lengths)
        for p in s.prefills:
            self.observe_prefill(p.cluster, p.tokens, p.seconds)
        self._outputs.extend(s.output_tokens)
        self._link_bps = s.link_rate_bps
        c = self.config
        if self._planned_link_bps is None:
            self._planned_link_bps = self.case.link_bytes_per_s * 8
        moved = abs(s.link_rate_bps - self._planned_link_bps) > c.link_change * self._planned_link_bps
        if s.now_s - self._period_start < c.period_s and not (c.link_change and moved):
            return None
        elapsed = max(s.now_s - self._period_start, 1e-9)
        self._period_start, self._planned_link_bps = s.now_s, s.link_rate_bps
        rate = len(self._lengths) / elapsed
        lengths = self._lengths
        if len(lengths) < c.min_requests:  # a short sample (an early re-plan): top it up with the last one
            lengths = self._previous[len(lengths) - c.min_requests :] + lengths
        self._previous, self._lengths = lengths, []
        if self._outputs:  # the output length of the period's requests, as measured
            self.case = self.case.with_overrides(output_tokens=sum(self._outputs) / len(self._outputs))
        self._outputs = []
        decision = self._decide(s, lengths, rate)
        self.reasons[decision.reason] += 1
        self.decisions.append(decision)
        log.info("rebalance: %s, t %d, N_p %d, N_d %d (planned %.3f req/s vs %.3f now, %d prompts, %.2f req/s)",
                 decision.reason, decision.threshold, decision.n_prefill, decision.n_decode, decision.planned_rps,
                 decision.current_rps, len(lengths), decision.rate_rps)  # fmt: skip
        return decision

    def _decide(self, s: Signals, lengths: list[int], rate: float) -> RebalanceDecision:
        def keep(reason: RebalanceReason) -> RebalanceDecision:
            return RebalanceDecision(s.now_s, reason, self.threshold, self.n_prefill, self.n_decode, rate_rps=rate)

        if not self.config.enabled:
            return keep(RebalanceReason.OFF)
        if len(lengths) < self.config.min_requests:
            return keep(RebalanceReason.FEW_REQUESTS)
        if s.link_rate_bps <= 0:
            return keep(RebalanceReason.LINK_DOWN)
        if s.pd_prefill.nodes + s.decode.nodes < self.case.n_pd:
            return keep(RebalanceReason.CONVERTING)
        case = self.current_case(lengths)
        grid = SearchGrid(self.config.threshold_step)
        best = best_prfaas(case, grid)
        planned_rps = best.throughput_rps
        current_t, current_rps = _best_threshold(case, grid, self.n_prefill, self.n_decode)
        moves = best.n_prefill - self.n_prefill
        step = 0
        if moves and planned_rps >= current_rps * (1 + self.config.min_gain):
            step = max(-self.config.max_conversions, min(self.config.max_conversions, moves))
            self.n_prefill, self.n_decode = self.n_prefill + step, self.n_decode - step
        # t for the split we will actually have (a partial move is not the planner's split)
        if step == moves:
            threshold = int(best.threshold_tokens or 0)
        elif step == 0:
            threshold = current_t
        else:
            threshold = _best_threshold(case, grid, self.n_prefill, self.n_decode)[0]
        if step:
            reason = RebalanceReason.CONVERT
        else:
            retune = RebalanceReason.RETUNE if threshold != self.threshold else RebalanceReason.KEEP
            reason = RebalanceReason.SMALL_GAIN if moves else retune
        self.threshold = threshold
        mean_length = float(np.mean(lengths))
        return RebalanceDecision(
            s.now_s, reason, threshold, self.n_prefill, self.n_decode, step, planned_rps, current_rps, rate, mean_length
        )

    def current_case(self, lengths: list[int]) -> PlanCase:
        """The planning case of the traffic and instances as measured now."""
        return self.case.with_overrides(
            lengths=LengthDistribution.empirical("recent traffic", lengths),
            link_gbps=self._link_bps / 1e9 if self._link_bps > 0 else None,
            prfaas=self._scaled(self.case.prfaas, "prfaas"),
            pd_prefill=self._scaled(self.case.pd_prefill, "pd"),
        )

    def _scaled(self, profile: PrefillProfile, cluster: str) -> PrefillProfile:
        measured, profiled = self._measured.get(cluster, (0.0, 0.0))
        if measured <= 0 or profiled <= 0:
            return profile
        return profile.slowed(measured / profiled)


def _best_threshold(case: PlanCase, grid: SearchGrid, n_prefill: int, n_decode: int) -> tuple[int, float]:
    """The best t for a fixed split and its Lambda_max; ties broken as the planner breaks them."""
    thresholds = grid.thresholds(case)
    s = stages(case, thresholds, case.n_prfaas, n_prefill, n_decode)
    with np.errstate(invalid="ignore", divide="ignore"):
        imbalance = np.abs(s["bound_prfaas"] - s["bound_pdp"]) / s["lambda"]
    imbalance = np.where(np.isfinite(imbalance), imbalance, np.inf)
    i = int(np.lexsort((s["egress_gbps"], imbalance, -np.round(s["lambda"], 9)))[0])
    return int(thresholds[i]), float(s["lambda"][i])
