"""How fast the simulator runs: one hour of Poisson traffic on a 10,000-GPU PrfaaS deployment.

The paper's case scaled to 10,000 GPUs (1,250 eight-GPU instances, PrfaaS:PD
instances 1:2 as in the case study, link scaled with it), planned by the
planner, offered Poisson arrivals at ``--load`` of the planned capacity with
the paper's workload. Prints the wall time, the events per second and what
the simulated deployment did beside what the planner expected.

    python benchmarks/bench_sim.py                 # the reference run: 10,000 GPUs, 3,600 s, load 0.8
    python benchmarks/bench_sim.py --gpus 1000 --duration 600

``--quick`` is the smoke run the tests make: 1,000 GPUs for 300 s unless
given, the same code path; ``--json`` ends with one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import time

from minifaas import figures
from minifaas.commands.arguments import count, positive, positive_int
from minifaas.commands.sim import scaled_case
from minifaas.planner.paper import paper_case
from minifaas.planner.search import plan
from minifaas.sim.arrivals import ArrivalKind, ArrivalSpec
from minifaas.sim.deployment import config_for
from minifaas.sim.fluid_link import LinkConfig
from minifaas.sim.simulator import Simulation
from minifaas.sim.workload import synthetic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=positive_int, default=10_000)
    parser.add_argument("--duration", type=positive, default=3_600.0)
    parser.add_argument("--load", type=positive, default=0.8)
    parser.add_argument("--seed", type=count, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: smaller sizes, the same code path")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    if args.quick:  # flags given on the command line still win
        parser.set_defaults(gpus=1_000, duration=300.0)
        args = parser.parse_args()

    try:
        case = scaled_case(paper_case(), args.gpus, None)
    except ValueError as e:  # too few GPUs for the case's instances
        parser.error(f"--gpus {args.gpus}: {e}")
    point = plan(case).prfaas
    link = LinkConfig(case.link_gbps, rtt_s=0.01, pipeline_layers=61)
    config = config_for(case, point, link, warmup_s=120.0)
    arrivals = ArrivalSpec(ArrivalKind.POISSON, args.load * point.throughput_rps)

    started = time.perf_counter()
    workload = synthetic(case.lengths, round(case.output_tokens), arrivals, args.duration, args.seed)
    generated = time.perf_counter()
    result = Simulation(config, workload).run()
    finished = time.perf_counter()

    sim_s = finished - generated
    print(
        f"deployment   {config.gpus} GPUs: {config.n_prfaas} PrfaaS + {config.n_prefill} PD-P + {config.n_decode} PD-D"
    )
    print(f"             instances, t = {config.threshold} tokens, link {case.link_gbps:.0f} Gbps")
    print(f"workload     {len(workload):,} requests over {args.duration:.0f} s ({workload.name})")
    print(f"wall time    {generated - started:.2f} s to generate, {sim_s:.2f} s to simulate")
    print(f"speed        {result.events / sim_s:,.0f} events/s, {len(workload) / sim_s:,.0f} requests/s")
    offered, planned = arrivals.rate, point.throughput_rps
    print(f"throughput   {result.throughput_rps:.1f} req/s (offered {offered:.1f}), planned max {planned:.1f}")
    print(f"ttft         mean {result.ttft_mean_s:.2f} s, p90 {result.ttft_p90_s:.2f} s, p99 {result.ttft_p99_s:.2f} s")
    print(f"egress       mean {result.egress_gbps_mean:.0f} Gbps, p99 {result.egress_gbps_p99:.0f} Gbps")
    print(f"             planned {point.egress_gbps * args.load:.0f} Gbps at this load")
    if args.json:
        measured = {
            "gpus": config.gpus,
            "requests": len(workload),
            "duration_s": args.duration,
            "generate_s": generated - started,
            "simulate_s": sim_s,
            "events_per_s": result.events / sim_s,
            "throughput_rps": result.throughput_rps,
            "offered_rps": offered,
            "planned_rps": planned,
            "ttft_p90_s": result.ttft_p90_s,
            "egress_gbps_mean": result.egress_gbps_mean,
        }
        print(figures.dumps({"bench": "sim", **measured}))


if __name__ == "__main__":
    main()
