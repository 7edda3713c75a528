"""The short-term policy (seconds): move the offload threshold t with the link, pick the routing rule.

Each tick it reads one ``Signals`` and returns one ``ThresholdDecision``:
  raise t   the link nears its ceiling, its health degrades (rtt inflation,
            retransmissions), it is cut, or the PrfaaS queue surges while PD-P
            waits less: fewer, longer prompts cross the link;
  lower t   the link has had headroom for a while: back towards the base t
            (the planner's, set by the long-term policy), never below it;
  hold      anything else, and always when the policy is off (fixed t); and
            under pressure when PD-P already waits longer than the PrfaaS path
            (its queue plus the link's backlog): raising t would only move the
            wait to a busier stage. So t settles where the two waits balance.

Constants (why these values):
  high_utilisation 0.85 / low_utilisation 0.60: the link is a processor-sharing
    pipe; a transfer's slowdown is about 1/(1-u): 6.7x at 0.85, where TTFT
    starts to blow up, 2.5x at 0.60. The 0.25 gap is wider than one raise step
    moves egress in the paper's length mix (x1.25 on t cuts egress by about
    20-25% near t = 19K), so a raise cannot by itself trigger a lower.
  smoothing 0.5: an EWMA over one-second samples. A single KV burst is at most
    a few seconds of link time; half-weight lets a real saturation through in
    3 ticks (0.3 -> 0.65 -> 0.83 -> 0.91) while one idle second does not undo it.
  raise_factor 1.25 at most every 5 ticks, lower_factor 0.9 after 5 ticks of
    headroom: multiplicative increase, gentle decrease, as TCP does it the other
    way round (here raising t is the back-off). A raise shows on the link and
    the queues only once the prefills already placed have drained: a long
    prefill on H200 is 2-4 s, plus its transfer tail. With a gap of 2 ticks the
    simulator (paper case, mix shifted to mu = 10.2) kept raising on queues a
    raise had already relieved: t overshot to 66K and TTFT p99 went from 15 s
    (fixed t) to 47 s; with 5 it peaks at 45K and p99 is 14 s. The slower,
    smaller lower step takes ~40 s to undo three raises, cheap next to the cost
    of re-saturating. min_step_tokens 64 lets t leave 0 (naive offloading).
  rtt_inflation 2.0, retrans_high 0.01: twice the lowest rtt seen means a
    standing queue at the bottleneck; 1% retransmitted bytes is where TCP
    throughput on a long path falls well below the line rate (Mathis et al.).
  surge_per_node 3.0, surge_imbalance 2.0: one prefill running and two waiting
    per PrfaaS node, and the PrfaaS path (its queue plus the link backlog)
    waiting twice as long as PD-P: Poisson bursts alone reach the first at 70%
    load, so the second keeps a burst that both sides share from moving t.
  abundant_below 0.3 / scarce_above 0.6: cross-cluster cache moves (ABUNDANT)
    add egress of their own, so they are allowed only with most of the link
    free; and only while PD-P waits no longer than the PrfaaS path, because
    ABUNDANT turns offloads into local prefills (on the Mooncake trace at twice
    its rate, ABUNDANT with PD-P saturated doubled TTFT p90: docs/STUDIES.md 7).
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


class Reason(StrEnum):
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
    reason: Reason
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
    reasons: Counter[Reason] = field(default_factory=Counter)
    rule_changes: int = 0
    history: deque[ThresholdDecision] = field(default_factory=lambda: deque(maxlen=4096))
    _smoothed: float | None = None
    _min_rtt_ms: float = 0.0
    _since_raise: int = 1 << 30
    _headroom_run: int = 0

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError("the threshold must be >= 0")
        if self.base < 0:
            self.base = self.threshold

    @property
    def utilisation(self) -> float:
        return self._smoothed or 0.0

    def set_base(self, base: int) -> None:
        """A new base t (the long-term policy re-planned); t jumps up to it at once if below."""
        self.base = max(0, base)
        if self.config.enabled and self.threshold < self.base:
            self.threshold = self.base

    def step(self, s: Signals) -> ThresholdDecision:
        c = self.config
        u = s.utilisation
        self._smoothed = u if self._smoothed is None else c.smoothing * u + (1 - c.smoothing) * self._smoothed
        if s.rtt_ms > 0:
            self._min_rtt_ms = s.rtt_ms if self._min_rtt_ms == 0 else min(self._min_rtt_ms, s.rtt_ms)
        self._since_raise += 1
        previous, previous_rule = self.threshold, self.rule
        if not c.enabled:
            action, reason = Action.HOLD, Reason.FIXED
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

    def _move(self, s: Signals) -> tuple[Action, Reason]:
        c = self.config
        pressure = self._pressure(s)
        if pressure is not None:
            self._headroom_run = 0
            if self.threshold >= c.ceiling:
                return Action.HOLD, Reason.AT_CEILING
            if pressure is not Reason.LINK_DOWN and s.pd_prefill.wait_s > s.prfaas.wait_s + s.link_backlog_s:
                return Action.HOLD, Reason.PD_BUSIER
            if self._since_raise < c.raise_gap_ticks:
                return Action.HOLD, Reason.COOLDOWN
            raised = max(round(self.threshold * c.raise_factor), self.threshold + c.min_step_tokens)
            self.threshold = min(c.ceiling, raised)
            self._since_raise = 0
            return Action.RAISE, pressure
        if self.utilisation >= c.low_utilisation:
            self._headroom_run = 0
            return Action.HOLD, Reason.STEADY
        self._headroom_run += 1
        if self.threshold <= self.base:
            return Action.HOLD, Reason.AT_BASE
        if self._headroom_run < c.headroom_ticks:
            return Action.HOLD, Reason.STEADY
        self._headroom_run = 0
        lowered = min(round(self.threshold * c.lower_factor), self.threshold - c.min_step_tokens)
        self.threshold = max(self.base, lowered)
        return Action.LOWER, Reason.HEADROOM

    def _pressure(self, s: Signals) -> Reason | None:
        c = self.config
        if s.link_rate_bps <= 0:
            return Reason.LINK_DOWN
        if self.utilisation >= c.high_utilisation:
            return Reason.LINK_SATURATED
        if self._degraded(s):
            return Reason.LINK_DEGRADED
        surge = s.prfaas.per_node >= c.surge_per_node and s.prfaas.per_node > s.pd_prefill.per_node
        if surge and s.prfaas.wait_s + s.link_backlog_s >= c.surge_imbalance * s.pd_prefill.wait_s:
            return Reason.PRFAAS_QUEUE_SURGE
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
