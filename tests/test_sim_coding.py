"""KV compression in the simulator: the live policy's choice, a smaller flow on a slow link, off on a fast one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from minifaas.planner import plan
from minifaas.planner.paper import paper_case
from minifaas.policy.codec_policy import CodecEstimate, CompressionPolicy, TransferShape
from minifaas.sim.arrivals import ArrivalKind, ArrivalSpec
from minifaas.sim.coding import SimCoding
from minifaas.sim.deployment import GPU_LOSSLESS, config_for
from minifaas.sim.fluid_link import LinkConfig
from minifaas.sim.report import SimResult
from minifaas.sim.simulator import PRFAAS, Simulation
from minifaas.sim.workload import synthetic


def simulate(gbps: float, mode: str, codec: CodecEstimate = GPU_LOSSLESS) -> SimResult:
    case = paper_case().with_overrides(link_gbps=gbps)
    point = plan(paper_case()).prfaas  # one deployment, planned for the paper's link, on every link
    link = LinkConfig(gbps, rtt_s=0.01, pipeline_layers=61)
    config = config_for(case, point, link, kv_compression=mode, codecs=(("lossless", codec),))
    arrivals = ArrivalSpec(ArrivalKind.POISSON, 0.6 * point.throughput_rps)
    return Simulation(config, synthetic(case.lengths, round(case.output_tokens), arrivals, 300.0, 3)).run()


def test_the_simulator_asks_the_live_policy() -> None:
    coding = SimCoding("auto", (("lossless", GPU_LOSSLESS),))
    assert isinstance(coding.policy, CompressionPolicy)
    alone = TransferShape(1e9)
    slow = coding.transfer(alone, 10e9, 0.0, 0)
    assert slow == pytest.approx((1e9 / 1.3, 1e9 / 200e9 * 2)) and coding.chosen["lossless"] == 1
    assert coding.transfer(alone, 1e12, 0.0, 0) == (1e9, 0.0) and coding.chosen["none"] == 1
    streamed = coding.transfer(TransferShape(1e9, prefill_s=1.0, tail_bytes=1e7), 10e9, 0.0, 0)
    assert streamed == pytest.approx((1e9 / 1.3, 1e7 / 200e9 * 2))  # only the tail's coding waits


def test_auto_codes_on_a_scarce_link_and_gets_there_sooner() -> None:
    none, auto = simulate(5.0, "none"), simulate(5.0, "auto")
    assert auto.kv_coded_fraction == 1.0 and auto.kv_wire_ratio == pytest.approx(1.3)
    assert none.kv_coded_fraction == 0.0 and none.kv_wire_ratio == 1.0
    assert auto.egress_gbps_mean < none.egress_gbps_mean
    assert auto.ttft_p90_s < 0.9 * none.ttft_p90_s


def test_auto_leaves_a_link_above_break_even_alone() -> None:
    break_even_gbps = 8 * GPU_LOSSLESS.break_even_bps / 1e9  # 185 Gbit/s
    fast = simulate(2 * break_even_gbps, "auto")
    assert fast.kv_coded_fraction == 0.0
    assert fast.ttft_mean_s == simulate(2 * break_even_gbps, "none").ttft_mean_s
    assert simulate(2 * break_even_gbps, "lossless").kv_coded_fraction == 1.0  # forced, it codes anyway


def test_the_links_backlog_counts_the_coded_bytes() -> None:
    """As the gateway counts it: what a PrfaaS transfer puts on the wire, from its routing until it has crossed."""
    case = paper_case()
    link = LinkConfig(100.0, schedule=((100.0, 0.0),))  # cut for good: what is on the link then stays counted
    config = config_for(case, plan(case).prfaas, link, kv_compression="lossless", codecs=(("lossless", GPU_LOSSLESS),))
    workload = synthetic(case.lengths, 64, ArrivalSpec(ArrivalKind.UNIFORM, 0.5), 300.0, seed=6)
    sim = Simulation(replace(config, threshold=0, n_prefill=1), workload)
    sim.run()
    stuck = [r for r, path in enumerate(sim.path) if path == PRFAAS and math.isnan(sim.finished[r])]
    state = sum(sim.prfaas.kv_bytes(int(workload.input_tokens[r])) for r in stuck)
    assert stuck and sim._link_committed == pytest.approx(state / GPU_LOSSLESS.ratio)
