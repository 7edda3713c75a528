"""The scheduler's policies on synthetic signal sequences (no event loop, no sockets)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from minifaas.planner import LengthDistribution
from minifaas.planner.paper import paper_case
from minifaas.policy.long_term import LongTermConfig, LongTermPolicy
from minifaas.policy.long_term import RebalanceReason as LongReason
from minifaas.policy.router import Rule
from minifaas.policy.short_term import Action, ShortTermConfig, ShortTermPolicy
from minifaas.policy.short_term import ThresholdReason as ShortReason
from minifaas.policy.signals import PrefillSample, Signals, StageLoad

GBPS = 1e9


def signals(now: float, utilisation: float, rate: float = 10 * GBPS, **extra: object) -> Signals:
    fields: dict[str, object] = {
        "prfaas": StageLoad(4, 4),
        "pd_prefill": StageLoad(3, 3),
        "decode": StageLoad(5, 50),
    }
    fields.update(extra)
    return Signals(now, rate, utilisation * rate, **fields)  # type: ignore[arg-type]


def run(policy: ShortTermPolicy, readings: list[float], **extra: object) -> list[int]:
    return [policy.step(signals(float(i), u, **extra)).threshold for i, u in enumerate(readings)]


def test_a_saturating_link_raises_t_within_three_ticks() -> None:
    policy = ShortTermPolicy(ShortTermConfig(), threshold=19_000)
    ts = run(policy, [0.3] * 5 + [1.0] * 3)
    assert ts[:5] == [19_000] * 5
    assert ts[-1] > 19_000, ts
    assert policy.reasons[ShortReason.LINK_SATURATED] >= 1


def test_a_saturated_link_keeps_raising_up_to_the_ceiling() -> None:
    policy = ShortTermPolicy(ShortTermConfig(ceiling=60_000), threshold=19_000)
    ts = run(policy, [1.0] * 40)
    assert ts[-1] == 60_000 and all(a <= b for a, b in itertools.pairwise(ts))
    assert policy.reasons[ShortReason.AT_CEILING] > 0


def test_a_quiet_link_returns_t_to_its_base() -> None:
    policy = ShortTermPolicy(ShortTermConfig(), threshold=19_000)
    ts = run(policy, [1.0] * 12 + [0.2] * 200)
    peak = max(ts)
    assert peak > 19_000 * 1.5
    assert ts[-1] == 19_000
    assert all(a >= b for a, b in itertools.pairwise(ts[ts.index(peak) :]))  # straight back down
    assert policy.reasons[ShortReason.HEADROOM] > 0


@pytest.mark.parametrize("level", [0.0, 0.3, 0.59, 0.6, 0.7, 0.84, 0.85, 0.95, 1.0])
def test_no_oscillation_on_a_steady_signal(level: float) -> None:
    policy = ShortTermPolicy(ShortTermConfig(ceiling=200_000), threshold=19_000)
    policy.set_base(10_000)  # room to move down as well as up
    ts = run(policy, [level] * 300)
    moves = [b - a for a, b in itertools.pairwise(ts) if b != a]
    assert all(m > 0 for m in moves) or all(m < 0 for m in moves), f"direction changed at {level}: {moves}"
    tail = ts[-50:]
    assert len(set(tail)) == 1, "still moving after 250 ticks of the same signal"


def test_the_closed_loop_settles_inside_the_band() -> None:
    """A plant: egress falls as t rises (the paper's mix on a 10 Gbps link at 3 req/s)."""
    case = paper_case()
    rate_rps, link_bps = 3.0, 10 * GBPS

    def egress(t: int) -> float:
        p, l_long, _ = case.lengths.split(float(t))
        return float(rate_rps * p * case.prfaas.kv_bytes(np.nan_to_num(l_long)) * 8)

    policy = ShortTermPolicy(ShortTermConfig(ceiling=128_000), threshold=4_000)
    ts = []
    for i in range(400):
        reading = Signals(float(i), link_bps, min(egress(policy.threshold), link_bps), *_stages())
        ts.append(policy.step(reading).threshold)
    assert len(set(ts[-200:])) == 1, "the threshold keeps moving"
    assert egress(ts[-1]) / link_bps < ShortTermConfig().high_utilisation


def _stages() -> tuple[StageLoad, StageLoad, StageLoad]:
    return StageLoad(4, 4), StageLoad(3, 3), StageLoad(5, 50)


def test_degraded_health_and_queue_surges_raise_t_quiet_ones_do_not() -> None:
    def first_raise(**extra: object) -> ShortReason | None:
        policy = ShortTermPolicy(ShortTermConfig(), threshold=1_000)
        for i in range(10):
            d = policy.step(signals(float(i), 0.3, **extra))
            if d.action is Action.RAISE:
                return d.reason
        return None

    assert first_raise(retrans_rate=0.05) is ShortReason.LINK_DEGRADED
    assert first_raise(prfaas=StageLoad(2, 10, 20.0), pd_prefill=StageLoad(3, 3, 1.0)) is ShortReason.PRFAAS_QUEUE_SURGE
    assert first_raise(prfaas=StageLoad(2, 10, 20.0), pd_prefill=StageLoad(3, 60, 90.0)) is None  # PD-P is worse
    assert first_raise(rate=0.0) is ShortReason.LINK_DOWN
    assert first_raise() is None

    policy = ShortTermPolicy(ShortTermConfig(), threshold=1_000)
    rtts = [10.0] * 5 + [35.0] * 5
    raised = [policy.step(signals(float(i), 0.3, rtt_ms=r)).action is Action.RAISE for i, r in enumerate(rtts)]
    assert not any(raised[:5]) and any(raised[5:])


def test_rule_follows_headroom_and_the_fixed_switch_holds_everything() -> None:
    policy = ShortTermPolicy(ShortTermConfig(), threshold=1_000)
    run(policy, [0.05] * 5)
    assert policy.rule is Rule.ABUNDANT
    run(policy, [0.95] * 5)
    assert policy.rule is Rule.SCARCE and policy.rule_changes == 2

    fixed = ShortTermPolicy(ShortTermConfig(enabled=False), threshold=1_000)
    assert set(run(fixed, [1.0] * 20 + [0.0] * 20)) == {1_000}
    assert fixed.rule is Rule.SCARCE and fixed.reasons == {ShortReason.FIXED: 40}


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        ShortTermConfig(low_utilisation=0.9, high_utilisation=0.8)
    with pytest.raises(ValueError):
        LongTermConfig(period_s=0)
    with pytest.raises(ValueError, match="link_change"):  # the message names the setting that is wrong
        LongTermConfig(link_change=-0.1)


def lengths_of(mu: float, n: int, seed: int = 0) -> list[int]:
    mix = LengthDistribution.lognormal(mu, 1.0, 128, 128_000)
    return mix.sample(np.random.default_rng(seed), n).tolist()


def feed(policy: LongTermPolicy, start: float, lengths: list[int], rate: float = 100 * GBPS) -> list:
    """One period of ticks, one second each, the lengths spread over them; returns the decisions."""
    period = int(policy.config.period_s)
    chunks = np.array_split(np.array(lengths), period)
    out = []
    for i, chunk in enumerate(chunks, start=1):
        d = policy.step(Signals(start + i, rate, 0.0, *_long_stages(policy), lengths=tuple(chunk.tolist())))
        if d is not None:
            out.append(d)
    return out


def _long_stages(policy: LongTermPolicy) -> tuple[StageLoad, StageLoad, StageLoad]:
    return StageLoad(policy.case.n_prfaas), StageLoad(policy.n_prefill), StageLoad(policy.n_decode)


def test_rebalancing_follows_a_shift_of_the_length_mix() -> None:
    case = paper_case()
    policy = LongTermPolicy(LongTermConfig(period_s=60, max_conversions=8), case, 19_000, 3, 5)
    (same,) = feed(policy, 0, lengths_of(9.9, 900))
    assert same.reason in (LongReason.KEEP, LongReason.RETUNE, LongReason.SMALL_GAIN)
    assert (policy.n_prefill, policy.n_decode) == (3, 5)

    (short,) = feed(policy, 60, lengths_of(9.0, 900, seed=1))  # shorter prompts: prefill is cheap, decode binds
    assert short.reason is LongReason.CONVERT and short.to_prefill < 0
    assert policy.n_prefill < 3 and short.threshold < 19_000
    assert short.planned_rps > short.current_rps

    (long,) = feed(policy, 120, lengths_of(10.4, 900, seed=2))  # longer prompts: more PD-P
    assert long.reason is LongReason.CONVERT and long.to_prefill > 0
    assert policy.n_prefill > 3 and long.threshold > 19_000
    assert policy.n_prefill + policy.n_decode == case.n_pd


def test_one_conversion_per_period_and_a_bandwidth_drop_moves_the_plan() -> None:
    policy = LongTermPolicy(LongTermConfig(period_s=60, link_change=0), paper_case(), 19_000, 3, 5)
    (d,) = feed(policy, 0, lengths_of(9.9, 900), rate=5 * GBPS)  # the planner wants N_p = 5 at 5 Gbps
    assert d.reason is LongReason.CONVERT and d.to_prefill == 1 and policy.n_prefill == 4
    assert d.threshold > 19_000


def test_a_link_change_replans_at_once_on_a_topped_up_sample() -> None:
    policy = LongTermPolicy(LongTermConfig(period_s=60), paper_case(), 19_000, 3, 5)
    (first,) = feed(policy, 0, lengths_of(9.9, 900))
    assert first.reason is not LongReason.CONVERT
    decisions = []
    for i in range(1, 11):  # the link falls to 5 Gbps: 10 ticks, 20 prompts, far fewer than min_requests
        signals = Signals(60.0 + i, 5 * GBPS, 0.0, *_long_stages(policy), lengths=(27_000, 20_000))
        decisions.append(policy.step(signals))
    early = decisions[0]
    assert early is not None and early.at_s == 61.0, "no re-plan on the tick the link changed"
    assert early.reason is LongReason.CONVERT and early.to_prefill == 1 and early.threshold > 19_000
    assert decisions[1:] == [None] * 9, "a steady new ceiling is planned for once"


def test_a_slower_prfaas_cluster_than_profiled_moves_workers_to_prefill() -> None:
    policy = LongTermPolicy(LongTermConfig(period_s=60), paper_case(), 19_000, 3, 5)
    for n in (8_000, 32_000, 64_000):
        policy.observe_prefill("prfaas", n, 2.0 * float(policy.case.prfaas.latency_s(n)))
    (d,) = feed(policy, 0, lengths_of(9.9, 900))
    assert d.reason is LongReason.CONVERT and d.to_prefill == 1 and d.threshold > 19_000


def test_few_requests_off_switch_and_draining_keep_the_split() -> None:
    few = LongTermPolicy(LongTermConfig(period_s=60), paper_case(), 19_000, 3, 5)
    assert [d.reason for d in feed(few, 0, lengths_of(9.0, 50))] == [LongReason.FEW_REQUESTS]
    off = LongTermPolicy(LongTermConfig(enabled=False, period_s=60), paper_case(), 19_000, 3, 5)
    assert [d.reason for d in feed(off, 0, lengths_of(9.0, 900))] == [LongReason.OFF]
    assert (off.n_prefill, off.n_decode, off.threshold) == (3, 5, 19_000)
    busy = LongTermPolicy(LongTermConfig(period_s=1), paper_case(), 19_000, 3, 5)
    d = busy.step(Signals(2.0, GBPS, 0.0, StageLoad(4), StageLoad(2), StageLoad(5), lengths=(1_000,) * 300))
    assert d is not None and d.reason is LongReason.CONVERTING


def test_the_long_term_policy_reads_prefills_and_outputs_from_the_signals_and_takes_back_a_failed_move() -> None:
    """What the live gateway measures comes in the signals: the prefills (a PrfaaS cluster twice as slow as
    profiled, as above) and the finished requests' output lengths, which price the plan's decode side."""
    policy = LongTermPolicy(LongTermConfig(period_s=60), paper_case(), 19_000, 3, 5)
    slow = tuple(PrefillSample("prfaas", n, 2.0 * float(policy.case.prfaas.latency_s(n))) for n in (8_000, 64_000))
    policy.step(Signals(0.5, 100 * GBPS, 0.0, *_long_stages(policy), prefills=slow, output_tokens=(100, 300)))
    (d,) = feed(policy, 0, lengths_of(9.9, 900))
    assert d.reason is LongReason.CONVERT and d.to_prefill == 1 and d.threshold > 19_000
    assert policy.case.output_tokens == 200
    policy.converted(d, ok=False)  # the worker kept its role: the split is the one before
    assert (policy.n_prefill, policy.n_decode) == (3, 5)
