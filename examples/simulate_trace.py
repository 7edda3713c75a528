"""A Mooncake trace replayed in the cluster simulator: the planned PrfaaS deployment against PD alone.

The simulator drives the live router and prefix-cache policy with the paper's
profiles (H200 PrfaaS, H20 PD) instead of models, so a trace of hours replays
in seconds. The planner sizes the paper's 96 GPUs for the trace's own prompt
lengths; then the first 1,500 requests (real lengths and shared-prefix block
ids), at 1.2 times their recorded rate, go through three deployments: PrfaaS
as planned, PrfaaS with the prefix cache off, and homogeneous PD, whose
prefill falls behind at this rate.

    python examples/simulate_trace.py [TRACE.jsonl]   # default: the Mooncake trace in data/traces
"""

from __future__ import annotations

import sys

from minifaas.planner import LengthDistribution, plan
from minifaas.planner.paper import paper_case
from minifaas.sim import Simulation, config_for, read_workload

REQUESTS, RATE_SCALE = 1500, 1.2


def main() -> None:
    trace = read_workload(sys.argv[1] if len(sys.argv) > 1 else "mooncake-synthetic", rate_scale=RATE_SCALE)
    workload = trace.head(REQUESTS)
    mean_in = workload.input_tokens.mean()
    print(
        f"{workload.name}: {len(workload)} requests over {workload.duration_s:.0f} s, mean prompt {mean_in:.0f} tokens"
    )

    case = paper_case().with_overrides(lengths=LengthDistribution.empirical("mooncake", trace.input_tokens))
    planned = plan(case)
    deployments = {
        "prfaas": config_for(case, planned.prfaas),
        "prfaas, no cache": config_for(case, planned.prfaas, prefix_cache=False),
        "homogeneous PD": config_for(case, planned.homogeneous),
    }
    print(
        f"{'deployment':<18}{'req/s':>7}{'TTFT p50':>10}{'TTFT p90':>10}{'offload':>9}{'prefix hit':>12}{'egress':>13}"
    )
    for name, config in deployments.items():
        r = Simulation(config, workload).run()
        assert r.completed == r.requests, f"{name}: {r.requests - r.completed} requests unfinished"
        print(
            f"{name:<18}{r.throughput_rps:>7.3f}{r.ttft_p50_s:>9.2f}s{r.ttft_p90_s:>9.2f}s{r.offload_fraction:>9.1%}"
            f"{r.prefix_hit_token_ratio:>12.1%}{r.egress_gbps_mean:>8.2f} Gbit/s"
        )
    p, h = planned.prfaas, planned.homogeneous
    print(
        f"planned: threshold {p.threshold_tokens:.0f} tokens, N_p {p.n_prefill} N_d {p.n_decode}, "
        f"{p.throughput_rps:.2f} req/s (homogeneous {h.throughput_rps:.2f}); every request completed"
    )


if __name__ == "__main__":
    main()
