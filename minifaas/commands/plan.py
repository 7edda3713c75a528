"""``minifaas plan``: solve the throughput model for a case and print the three configurations.

minifaas plan --case paper                 # the paper's case study, a table
minifaas plan --case paper --json          # one JSON object {prfaas, homogeneous, naive}
minifaas plan --case my.toml --link-gbps 25 --plot out.png
"""

from __future__ import annotations

import argparse
import math

from minifaas import figures
from minifaas.commands import arguments
from minifaas.commands.main import user_input
from minifaas.planner.case import PlanCase
from minifaas.planner.model import OperatingPoint
from minifaas.planner.paper import named_case
from minifaas.planner.plot import plot_plan
from minifaas.planner.search import Plan, SearchGrid, plan
from minifaas.plotting import draw_or_say


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--case", default="paper", help="a named case (paper) or a TOML/JSON case file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=arguments.figure_file, metavar="FILE",
                        help=f"draw the bounds vs N_p and vs t in {arguments.FIGURE_HELP} (needs matplotlib; "
                        "default: no plot)")  # fmt: skip
    parser.add_argument(
        "--link-gbps", type=arguments.positive, help="PrfaaS egress bandwidth in Gbit/s (default: the case's)"
    )
    parser.add_argument("--n-prfaas", type=arguments.count, help="PrfaaS instances (default: the case's)")
    parser.add_argument("--n-pd", type=int, help="PD instances, N_p + N_d (default: the case's)")
    parser.add_argument("--n-homogeneous", type=int, help="instances of the homogeneous baseline (default: the case's)")
    parser.add_argument(
        "--output-tokens", type=arguments.positive, help="mean output length in tokens (default: the case's)"
    )
    parser.add_argument("--threshold-step", type=arguments.positive_int, default=100, help="grid step of t in tokens")
    arguments.add_kv_arguments(parser)
    parser.add_argument(
        "--expected-latency", action="store_true", help="price prefill by E[T(L)] instead of the paper's T(E[L])"
    )
    parser.add_argument(
        "--price-ratio",
        type=arguments.positive,
        help="price of a PrfaaS GPU over a PD GPU: adds cost figures (default: none)",
    )


def cost_units(case: PlanCase, op: OperatingPoint, price_ratio: float) -> float:
    """GPU-hours priced in PD-cluster GPUs: PrfaaS GPUs count ``price_ratio`` each."""
    prfaas_gpus = op.n_prfaas * case.prfaas.gpus_per_instance
    pd_gpus = (op.n_prefill + op.n_decode) * case.decode.gpus_per_instance
    return prfaas_gpus * price_ratio + pd_gpus


def to_json(case: PlanCase, result: Plan, price_ratio: float | None) -> dict[str, dict[str, object]]:
    out = result.to_dict()
    if price_ratio is not None:
        for op in (result.prfaas, result.homogeneous, result.naive):
            cost = cost_units(case, op, price_ratio)
            out[op.config] |= {"cost_units": cost, "throughput_per_100_cost": 100 * op.throughput_rps / cost}
    return out


def run(args: argparse.Namespace) -> int:
    with user_input():
        flags = {k: getattr(args, k) for k in ("link_gbps", "n_prfaas", "n_pd", "n_homogeneous", "output_tokens")}
        case = named_case(args.case).with_overrides(**flags).with_kv(args.kv_bytes_per_token, args.kv_fixed_bytes)
        grid = SearchGrid(threshold_step=args.threshold_step)
    result = plan(case, grid, args.expected_latency)
    if args.json:
        print(figures.dumps(to_json(case, result, args.price_ratio), indent=2))
    else:
        print_plan(case, result, args.price_ratio)
    if args.plot:
        draw_or_say(args.plot, lambda png: plot_plan(case, result, grid, png))
    return 0


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_plan(case: PlanCase, result: Plan, price_ratio: float | None = None) -> None:
    print(
        f"case {case.name}: {case.gpus} GPUs in PrfaaS + PD, lengths {case.lengths.name}, mean {case.lengths.mean:.0f}"
    )
    ops: tuple[OperatingPoint, ...] = (result.prfaas, result.homogeneous, result.naive)
    rows = [["config", "t", "Nprf", "Np", "Nd", "p", "l_long", "l_short", "Th_prf", "Th_pdp", "Th_pdd", "req/s",
             "Gbps", "bottleneck"]]  # fmt: skip
    for op in ops:
        rows.append([
            op.config, _fmt(op.threshold_tokens, ".0f"), str(op.n_prfaas), str(op.n_prefill), str(op.n_decode),
            f"{op.offload_fraction:.3f}", _fmt(op.l_long, ".0f"), _fmt(op.l_short, ".0f"),
            _fmt(op.theta_prfaas, ".3f"), _fmt(op.theta_pdp, ".3f"), f"{op.theta_pdd:.3f}",
            f"{op.throughput_rps:.3f}", _fmt(op.egress_gbps, ".1f"), op.bottleneck,
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:  # the name left, the figures right, two spaces apart whatever their width
        cells = [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:-1], widths[1:-1], strict=True)), row[-1]]
        print("  ".join(cells))
    gains = [f"{g:+.1%}" if math.isfinite(g) else "- (it serves nothing)" for g in
             (result.gain_vs_homogeneous, result.gain_vs_naive)]  # fmt: skip
    print(f"PrfaaS vs homogeneous: {gains[0]}; vs naive: {gains[1]}")
    if price_ratio is not None:
        for op in ops:
            cost = cost_units(case, op, price_ratio)
            print(f"{op.config:<12} cost {cost:.0f} PD-GPU units, {100 * op.throughput_rps / cost:.3f} req/s per 100")
