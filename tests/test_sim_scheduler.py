"""The scheduler driving the simulator: t follows a bandwidth drop, PD workers change role, nothing is lost."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from minifaas.planner import LengthDistribution, plan
from minifaas.planner.paper import paper_case
from minifaas.policy.long_term import LongTermConfig
from minifaas.policy.short_term import ShortTermConfig
from minifaas.sim.arrivals import ArrivalKind, ArrivalSpec
from minifaas.sim.deployment import config_for
from minifaas.sim.fluid_link import LinkConfig
from minifaas.sim.simulator import Simulation
from minifaas.sim.workload import Workload, synthetic

CASE = paper_case()
PLANNED = plan(CASE).prfaas
RATE = 0.7 * PLANNED.throughput_rps


def test_a_bandwidth_drop_raises_t_and_recovery_brings_it_back() -> None:
    link = LinkConfig(100.0, 0.01, 61, ((300.0, 6.0), (900.0, 100.0)))
    config = replace(config_for(CASE, PLANNED, link), short_term=ShortTermConfig(ceiling=128_000))
    workload = synthetic(CASE.lengths, 1024, ArrivalSpec(ArrivalKind.POISSON, RATE), 1_500.0, seed=3)
    fixed = Simulation(replace(config, short_term=None), workload).run()
    adaptive = Simulation(config, workload).run()

    t = adaptive.schedule[:, 1]
    at = adaptive.schedule[:, 0]
    before, during, after = t[at < 300], t[(at > 330) & (at < 900)], t[at > 1_400]
    assert before.max() < 2 * PLANNED.threshold_tokens
    assert during.max() > 1.3 * PLANNED.threshold_tokens, "t did not rise when the link fell to 6 Gbps"
    assert after[-1] <= before.max(), "t did not come back once the link recovered"
    assert adaptive.completed == fixed.completed == len(workload)
    assert adaptive.ttft_p99_s < fixed.ttft_p99_s
    assert fixed.threshold_changes == 0 and set(fixed.schedule[:, 1]) <= {PLANNED.threshold_tokens}


def test_role_conversion_follows_longer_prompts_and_loses_nothing() -> None:
    longer = LengthDistribution.lognormal(10.4, 1.0, 128, 128_000)
    arrivals = ArrivalSpec(ArrivalKind.POISSON, 0.8 * 2.35)  # what the planner says the longer mix sustains
    a = synthetic(CASE.lengths, 1024, arrivals, 300.0, seed=1)
    b = synthetic(longer, 1024, arrivals, 900.0, seed=2)
    workload = Workload(
        "shift",
        np.concatenate((a.arrival_s, b.arrival_s + 300.0)),
        np.concatenate((a.input_tokens, b.input_tokens)),
        np.concatenate((a.output_tokens, b.output_tokens)),
    )
    base = config_for(CASE, PLANNED, LinkConfig(100.0, 0.01, 61))
    config = replace(base, long_term=LongTermConfig(period_s=300.0, min_requests=100), convert_s=30.0)
    result = Simulation(config, workload).run()

    sched = result.schedule
    assert result.role_conversions >= 1
    assert sched[-1, 2] > PLANNED.n_prefill and sched[-1, 2] + sched[-1, 3] == CASE.n_pd
    assert np.all(sched[:, 2] + sched[:, 3] >= CASE.n_pd - 1), "more than one worker out at a time"
    assert result.completed == result.requests == len(workload) and result.rejected == 0

    off = Simulation(replace(config, long_term=LongTermConfig(enabled=False)), workload).run()
    assert off.role_conversions == 0 and off.completed == len(workload)
