"""The scheduler side by side, in the simulator at paper scale: adaptive vs fixed threshold vs naive offloading.

Two scenarios on the paper's case (4 H200 PrfaaS + 8 H20 PD instances, 100 Gbps),
Poisson arrivals at ``--load`` of the planned PrfaaS capacity, one seed, the
same workload for every configuration:
  bandwidth drop  the link falls to ``--drop-gbps`` from 700 s to 1600 s, then recovers;
  length shift    the prompt mix moves from mu = 9.90 to ``--shift-mu`` at half time.
Configurations:
  adaptive  the planner's (t, N_p, N_d) to start, then the short-term policy
            (t and rule every second) and the long-term one (re-plan every
            ``--period`` s, one PD worker re-roled at a time, ``--convert-s`` to restart);
  t only    the short-term policy alone (no re-planning): the --no-rebalance ablation;
  fixed     the planner's (t, N_p, N_d), never changed;
  naive     every prefill on PrfaaS, every PD instance decodes, no threshold.

    python benchmarks/bench_scheduler.py
    python benchmarks/bench_scheduler.py --load 0.8 --drop-gbps 5 --shift-mu 10.4

``--quick`` is the smoke run the tests make: 2,000 s unless given (the drop
and its recovery still inside), the same code path; ``--json`` ends with one
JSON line of every row.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from minifaas import figures
from minifaas.commands.arguments import count, non_negative, positive
from minifaas.planner.lengths import LengthDistribution
from minifaas.planner.paper import paper_case
from minifaas.planner.search import plan
from minifaas.policy.long_term import LongTermConfig
from minifaas.policy.short_term import ShortTermConfig
from minifaas.sim.arrivals import ArrivalKind, ArrivalSpec
from minifaas.sim.deployment import SimConfig, config_for
from minifaas.sim.fluid_link import LinkConfig
from minifaas.sim.simulator import Simulation
from minifaas.sim.workload import Workload, synthetic

HEADER = (
    f"{'scenario':<15}{'config':<10}{'done/req':>12}{'failed':>8}{'tput rps':>10}{'ttft p90 s':>12}"
    f"{'ttft p99 s':>12}{'link util':>11}{'egress p99':>12}{'t final':>9}{'t max':>8}{'N_p/N_d':>9}{'conv':>6}"
)


def shifted(duration: float, rate: float, mu_after: float, seed: int) -> Workload:
    case = paper_case()
    arrivals = ArrivalSpec(ArrivalKind.POISSON, rate)
    first = synthetic(case.lengths, 1024, arrivals, duration / 2, seed)
    after = LengthDistribution.lognormal(mu_after, 1.0, 128, 128_000)
    second = synthetic(after, 1024, arrivals, duration / 2, seed + 1)
    return Workload(
        f"mu 9.90 -> {mu_after}",
        np.concatenate((first.arrival_s, second.arrival_s + duration / 2)),
        np.concatenate((first.input_tokens, second.input_tokens)),
        np.concatenate((first.output_tokens, second.output_tokens)),
    )


def configs(link: LinkConfig, period: float, convert_s: float) -> dict[str, SimConfig]:
    case = paper_case()
    planned = plan(case)
    fixed = config_for(case, planned.prfaas, link)
    return {
        "adaptive": replace(
            fixed,
            short_term=ShortTermConfig(ceiling=128_000),
            long_term=LongTermConfig(period_s=period),
            convert_s=convert_s,
        ),
        "t only": replace(fixed, short_term=ShortTermConfig(ceiling=128_000)),
        "fixed": fixed,
        "naive": config_for(case, planned.naive, link),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=positive, default=0.7)
    parser.add_argument("--duration", type=positive, default=3_000.0)
    parser.add_argument("--drop-gbps", type=positive, default=6.0)
    parser.add_argument("--shift-mu", type=float, default=10.2)
    parser.add_argument("--period", type=positive, default=300.0)
    parser.add_argument("--convert-s", type=non_negative, default=60.0)
    parser.add_argument("--seed", type=count, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: a shorter run, the same code path")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of every row")
    args = parser.parse_args()
    if args.quick:  # flags given on the command line still win
        parser.set_defaults(duration=2_000.0)
        args = parser.parse_args()

    case = paper_case()
    rate = args.load * plan(case).prfaas.throughput_rps
    steady = synthetic(case.lengths, 1024, ArrivalSpec(ArrivalKind.POISSON, rate), args.duration, args.seed)
    drop = LinkConfig(100.0, 0.01, 61, ((700.0, args.drop_gbps), (1600.0, 100.0)))
    scenarios = {
        f"drop {args.drop_gbps:g} Gbps": (steady, drop),
        f"mu -> {args.shift_mu}": (shifted(args.duration, rate, args.shift_mu, args.seed), LinkConfig(100.0, 0.01, 61)),
    }
    print(f"paper case, Poisson {rate:.3f} req/s ({args.load} x planned), {args.duration:.0f} s, seed {args.seed}")
    print(HEADER)
    started = time.perf_counter()
    rows = []
    for scenario, (workload, link) in scenarios.items():
        for name, config in configs(link, args.period, args.convert_s).items():
            r = Simulation(config, workload).run()
            n_p = int(r.schedule[-1, 2]) if len(r.schedule) else config.n_prefill
            n_d = int(r.schedule[-1, 3]) if len(r.schedule) else config.n_decode
            print(
                f"{scenario:<15}{name:<10}{f'{r.completed}/{r.requests}':>12}{r.requests - r.completed:>8}"
                f"{r.throughput_rps:>10.3f}{r.ttft_p90_s:>12.2f}{r.ttft_p99_s:>12.2f}{r.link_utilisation:>11.3f}"
                f"{r.egress_gbps_p99:>12.1f}{r.threshold_final:>9}{r.threshold_max:>8}{f'{n_p}/{n_d}':>9}"
                f"{r.role_conversions:>6}"
            )
            rows.append(
                {
                    "scenario": scenario,
                    "config": name,
                    "completed": r.completed,
                    "requests": r.requests,
                    "throughput_rps": r.throughput_rps,
                    "ttft_p90_s": r.ttft_p90_s,
                    "ttft_p99_s": r.ttft_p99_s,
                    "link_utilisation": r.link_utilisation,
                    "egress_gbps_p99": r.egress_gbps_p99,
                    "threshold_final": r.threshold_final,
                    "threshold_max": r.threshold_max,
                    "n_prefill": n_p,
                    "n_decode": n_d,
                    "role_conversions": r.role_conversions,
                }
            )
    print(f"({time.perf_counter() - started:.1f} s wall)")
    if args.json:
        print(figures.dumps({"bench": "scheduler", "load": args.load, "duration_s": args.duration, "rows": rows}))


if __name__ == "__main__":
    main()
