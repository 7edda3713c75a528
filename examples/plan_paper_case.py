"""The paper's case study through the planner: the routing threshold, the PD split, and the gain.

32 H200 in a PrfaaS cluster prefill long prompts and ship their KV over a
100 Gbit/s link to 64 H20 that prefill short prompts and decode everything.
The planner searches the threshold t (prompts longer than t go to PrfaaS) and
the split of the 64 H20 into N_p prefill and N_d decode instances for the most
requests per second, then compares with the two baselines on the same GPUs:
96 H20 doing PD alone (homogeneous) and PrfaaS taking every prefill (naive).

    python examples/plan_paper_case.py        # the same table: minifaas plan --case paper
"""

from __future__ import annotations

from minifaas.planner import OperatingPoint, operating_point, plan
from minifaas.planner.paper import REPORTED, paper_case


def describe(op: OperatingPoint) -> str:
    t = "-" if op.threshold_tokens is None else f"{op.threshold_tokens:.0f}"
    egress = "-" if op.egress_gbps is None else f"{op.egress_gbps:.1f} Gbit/s"
    return (
        f"{op.config:<12} t={t:>6}  PrfaaS {op.n_prfaas}  N_p {op.n_prefill}  N_d {op.n_decode}  "
        f"offload {op.offload_fraction:6.1%}  {op.throughput_rps:.3f} req/s  egress {egress:<13} "
        f"bound by {op.bottleneck}"
    )


def main() -> None:
    case = paper_case()
    print(f"case {case.name}: {case.gpus} GPUs, prompts {case.lengths.name}, mean {case.lengths.mean:.0f} tokens")
    print(f"{case.n_prfaas} PrfaaS + {case.n_pd} PD instances, {case.link_gbps:.0f} Gbit/s link\n")
    result = plan(case)
    for op in (result.prfaas, result.homogeneous, result.naive):
        print(describe(op))

    best = result.prfaas
    print(f"\nthreshold {best.threshold_tokens:.0f} tokens, split N_p={best.n_prefill} N_d={best.n_decode}")
    print(
        f"throughput vs homogeneous: {result.gain_vs_homogeneous:+.1%} (paper: +{REPORTED['gain_vs_homogeneous']:.0%})"
    )
    print(f"throughput vs naive:       {result.gain_vs_naive:+.1%} (paper: +{REPORTED['gain_vs_naive']:.0%})")
    print(f"PrfaaS egress at peak:     {best.egress_gbps:.1f} Gbit/s (paper: ~{REPORTED['prfaas_egress_gbps']:.0f})")

    print("\nwhy that threshold: the same split at other thresholds")
    for t in (5_000, 10_000, best.threshold_tokens, 40_000, 80_000):
        op = operating_point("prfaas", case, t, best.n_prfaas, best.n_prefill, best.n_decode)
        rate = f"{op.throughput_rps:.3f} req/s"
        print(f"  t={t:>6.0f}  offload {op.offload_fraction:6.1%}  {rate}  bound by {op.bottleneck}")


if __name__ == "__main__":
    main()
