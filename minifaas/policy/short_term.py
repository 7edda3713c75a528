"""The short-term policy (seconds): move the offload threshold t with the link, pick the routing rule.

Each tick raises t when the link saturates, degrades or is cut, or the PrfaaS queue surges; lowers it back
towards its base after a spell of headroom; and holds while PD-P already waits longer than the PrfaaS path,
so t settles where the two waits balance. docs/ARCHITECTURE.md gives each constant's reason.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import StrEnum

from minifaas.policy.router import Rule
from minifaas.policy.signals import Signals

log = logging.getLogger("minifaas.policy")


class Action(StrEnum):
    RAISE = "raise"
    LOWER = "lower"
    HOLD = "hold"


class ThresholdReason(StrEnum):
    FIXED = "fixed"  # the policy is off
    LINK_DOWN = "link_down"
    LINK_SATURATED = "link_saturated"
    LINK_DEGRADED = "link_degraded"  # rtt inflation or retransmissions
    PRFAAS_QUEUE_SURGE = "prfaas_queue_surge"
    HEADROOM = "headroom"
    COOLDOWN = "cooldown"  # pressure, but the last raise has not shown yet
    PD_BUSIER = "pd_busier"  # pressure, but PD-P waits longer than the PrfaaS path
    AT_CEILING = "at_ceiling"
    AT_BASE = "at_base"
    STEADY = "steady"  # inside the hysteresis band, or headroom not yet held long enough


@dataclass(frozen=True, slots=True)
class ShortTermConfig:
    enabled: bool = True  # off: t stays where it was set (the fixed-threshold ablation)
    ceiling: int = 10**9  # t never goes above this (the longest prompt served is a natural choice)
    high_utilisation: float = 0.85
    low_utilisation: float = 0.60
    smoothing: float = 0.5  # EWMA weight of the newest utilisation sample
    rtt_inflation: float = 2.0
    retrans_high: float = 0.01
    surge_per_node: float = 3.0
    surge_imbalance: float = 2.0  # a surge counts when the PrfaaS path waits this many times PD-P's wait
    raise_factor: float = 1.25
    lower_factor: float = 0.9
    min_step_tokens: int = 64
    raise_gap_ticks: int = 5
    headroom_ticks: int = 5
    abundant_below: float = 0.3
    scarce_above: float = 0.6

    def __post_init__(self) -> None:
        if not 0 < self.low_utilisation < self.high_utilisation <= 1:
            raise ValueError("need 0 < low_utilisation < high_utilisation <= 1")
        if not 0 <= self.abundant_below < self.scarce_above <= 1:
            raise ValueError("need 0 <= abundant_below < scarce_above <= 1")
        if not 0 < self.smoothing <= 1 or self.raise_factor <= 1 or not 0 < self.lower_factor < 1:
            raise ValueError("need 0 < smoothing <= 1, raise_factor > 1 and 0 < lower_factor < 1")
        if min(self.min_step_tokens, self.raise_gap_ticks, self.headroom_ticks, self.ceiling) < 1:
            raise ValueError("steps, tick counts and the ceiling must be >= 1")
        if self.rtt_inflation <= 1 or not 0 < self.retrans_high < 1 or self.surge_per_node <= 0:
            raise ValueError("need rtt_inflation > 1, 0 < retrans_high < 1, surge_per_node > 0")


@dataclass(frozen=True, slots=True)
class ThresholdDecision:
    at_s: float
    action: Action
    reason: ThresholdReason
    threshold: int  # t from now on
    previous: int
    rule: Rule
    utilisation: float  # the smoothed reading the decision was made on


@dataclass
class ShortTermPolicy:
    """Sans-IO: ``step`` is called once per sampling tick with that tick's signals."""

    config: ShortTermConfig
    threshold: int  # t now
    rule: Rule = Rule.SCARCE
    base: int = -1  # the lowest t it returns to; defaults to the starting t
    reasons: Counter[ThresholdReason] = field(default_factory=Counter, init=False)
    rule_changes: int = field(default=0, init=False)
    history: deque[ThresholdDecision] = field(default_factory=lambda: deque(maxlen=4096), init=False)
    _smoothed: float | None = field(default=None, init=False)
    _min_rtt_ms: float = field(default=0.0, init=False)
    _since_raise: int = field(default=1 << 30, init=False)
    _headroom_run: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        # the arguments may come from flags, each any JSON value
        if not isinstance(self.config, ShortTermConfig):
            raise TypeError(f"config must be a ShortTermConfig, got {self.config!r}")
        for name in ("threshold", "base"):
            if type(getattr(self, name)) is not int:  # true and false are not counts
                raise TypeError(f"{name} must be an integer, got {getattr(self, name)!r}")
        self.rule = Rule(self.rule)
        if self.threshold < 0:
            raise ValueError("the threshold must be >= 0")
        if self.base < 0:
            self.base = self.threshold

    @property
    def utilisation(self) -> float:
        return self._smoothed or 0.0

    def set_base(self, base: int) -> int:
        """A new base t (the long-term policy re-planned); t jumps up to it at once if below. Returns t now."""
        self.base = max(0, base)
        if self.config.enabled and self.threshold < self.base:
            self.threshold = self.base
        return self.threshold

    def step(self, s: Signals) -> ThresholdDecision:
        c = self.config
        u = s.utilisation
        self._smoothed = u if self._smoothed is None else c.smoothing * u + (1 - c.smoothing) * self._smoothed
        if s.rtt_ms > 0:
            self._min_rtt_ms = s.rtt_ms if self._min_rtt_ms == 0 else min(self._min_rtt_ms, s.rtt_ms)
        self._since_raise += 1
        previous, previous_rule = self.threshold, self.rule
        if not c.enabled:
            action, reason = Action.HOLD, ThresholdReason.FIXED
        else:
            action, reason = self._move(s)
            self.rule = self._pick_rule(s)
        decision = ThresholdDecision(s.now_s, action, reason, self.threshold, previous, self.rule, self.utilisation)
        self.reasons[reason] += 1
        self.rule_changes += self.rule is not previous_rule
        self.history.append(decision)
        changed = self.rule is not previous_rule
        level = logging.INFO if action is not Action.HOLD or changed else logging.DEBUG
        rule = f"{previous_rule} -> {self.rule}" if changed else str(self.rule)
        log.log(level, "t %d -> %d (%s: %s), rule %s, utilisation %.2f", previous, self.threshold, action,
                reason, rule, self.utilisation)  # fmt: skip
        return decision

    def _move(self, s: Signals) -> tuple[Action, ThresholdReason]:
        c = self.config
        pressure = self._pressure(s)
        if pressure is not None:
            self._headroom_run = 0
            if self.threshold >= c.ceiling:
                return Action.HOLD, ThresholdReason.AT_CEILING
            if pressure is not ThresholdReason.LINK_DOWN and s.pd_prefill.wait_s > s.prfaas.wait_s + s.link_backlog_s:
                return Action.HOLD, ThresholdReason.PD_BUSIER
            if self._since_raise < c.raise_gap_ticks:
                return Action.HOLD, ThresholdReason.COOLDOWN
            raised = max(round(self.threshold * c.raise_factor), self.threshold + c.min_step_tokens)
            self.threshold = min(c.ceiling, raised)
            self._since_raise = 0
            return Action.RAISE, pressure
        if self.utilisation >= c.low_utilisation:
            self._headroom_run = 0
            return Action.HOLD, ThresholdReason.STEADY
        self._headroom_run += 1
        if self.threshold <= self.base:
            return Action.HOLD, ThresholdReason.AT_BASE
        if self._headroom_run < c.headroom_ticks:
            return Action.HOLD, ThresholdReason.STEADY
        self._headroom_run = 0
        lowered = min(round(self.threshold * c.lower_factor), self.threshold - c.min_step_tokens)
        self.threshold = max(self.base, lowered)
        return Action.LOWER, ThresholdReason.HEADROOM

    def _pressure(self, s: Signals) -> ThresholdReason | None:
        c = self.config
        if s.link_rate_bps <= 0:
            return ThresholdReason.LINK_DOWN
        if self.utilisation >= c.high_utilisation:
            return ThresholdReason.LINK_SATURATED
        if self._degraded(s):
            return ThresholdReason.LINK_DEGRADED
        surge = s.prfaas.per_node >= c.surge_per_node and s.prfaas.per_node > s.pd_prefill.per_node
        if surge and s.prfaas.wait_s + s.link_backlog_s >= c.surge_imbalance * s.pd_prefill.wait_s:
            return ThresholdReason.PRFAAS_QUEUE_SURGE
        return None

    def _degraded(self, s: Signals) -> bool:
        inflated = self._min_rtt_ms > 0 and s.rtt_ms > self.config.rtt_inflation * self._min_rtt_ms
        return inflated or s.retrans_rate > self.config.retrans_high

    def _pick_rule(self, s: Signals) -> Rule:
        c = self.config
        if s.link_rate_bps <= 0 or self._degraded(s) or self.utilisation > c.scarce_above:
            return Rule.SCARCE
        if s.pd_prefill.wait_s > s.prfaas.wait_s + s.link_backlog_s:
            return Rule.SCARCE  # ABUNDANT makes more prefills local: not while PD-P is the busier side
        if self.utilisation < c.abundant_below and self.threshold <= self.base:
            return Rule.ABUNDANT
        return self.rule
