"""Simulator speed on a real trace: the Mooncake trace replayed, with prefix caching, beside NVIDIA Dynamo's replay.

    python benchmarks/bench_sim_replay.py [--repeats 5] [--quick] [--json]

For each configuration the planner picks for the paper's case (PrfaaS,
homogeneous PD, naive offloading), the whole trace (3,993 requests with one
prefix hash per 512-token block) goes from the file to the simulated results:
``read_workload``, then ``Simulation(...).run()`` with the prefix cache on.
Beside it, run in turn in the same process, Dynamo's offline replay
(``dynamo.replay.run_trace_replay``) of the same file with the same numbers of
prefill and decode workers (its disaggregated deployment; it has no second
prefill cluster, so the PrfaaS instances count as prefill workers), blocks of
512 tokens, and both of its routers: round robin and the KV-aware router (the
one that matches prefixes). Dynamo is optional: without it (``pip install
--no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1``, see docs/RESULTS.md)
only the minifaas rows are made. Figures are medians of ``--repeats``
interleaved rounds, in simulated requests per wall second; the ratios are
minifaas over the faster of Dynamo's two routers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minifaas.commands.arguments import positive_int
from minifaas.planner.paper import paper_case
from minifaas.planner.search import plan
from minifaas.sim.deployment import config_for
from minifaas.sim.fluid_link import LinkConfig
from minifaas.sim.simulator import Simulation
from minifaas.sim.workload import read_workload

TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
CONFIGS = ("homogeneous", "prfaas", "naive")
ROUTERS = ("round_robin", "kv_router")


def minifaas_replay(name: str) -> tuple[Callable[[], int], tuple[int, int]]:
    """A run of the trace through ``name``'s planned deployment, and its (prefill, decode) instance counts."""
    case = paper_case()
    point = getattr(plan(case), name)
    link = LinkConfig(case.link_gbps, rtt_s=0.01, pipeline_layers=61)  # what `minifaas sim` uses
    config = config_for(case, point, link)

    def run() -> int:
        workload = read_workload(TRACE)
        result = Simulation(config, workload).run()
        assert result.completed == len(workload), f"{name}: {result.completed} of {len(workload)} completed"
        return len(workload)

    return run, (config.n_prfaas + config.n_prefill, config.n_decode)


def dynamo_replay(prefill: int, decode: int, router: str) -> Callable[[], int] | None:
    """Dynamo's offline replay of the same trace file, or None when Dynamo is not installed."""
    os.environ.setdefault("DYN_LOG", "error")  # its router logs every request at info level
    try:
        from dynamo.replay import run_trace_replay
    except ImportError:
        return None

    def run() -> int:
        report = run_trace_replay(
            str(TRACE),
            prefill_engine_args={"engine": {"block_size": 512, "worker_type": "prefill"}},
            decode_engine_args={"engine": {"block_size": 512, "worker_type": "decode"}},
            num_prefill_workers=prefill,
            num_decode_workers=decode,
            trace_block_size=512,
            router_mode=router,
        )
        return int(report.summary["completed_requests"])

    return run


def timed(run: Callable[[], int]) -> float:
    """Simulated requests per wall second of one run."""
    start = time.perf_counter()
    requests = run()
    return requests / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=5, help="interleaved rounds; the figures are medians")
    parser.add_argument("--quick", action="store_true", help="a smoke run: one round, the same code path")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    if repeats < 1:
        parser.error("--repeats must be at least 1")

    runs: dict[str, Callable[[], int]] = {}
    counts: dict[str, tuple[int, int]] = {}
    for name in CONFIGS:
        runs[name], counts[name] = minifaas_replay(name)
        for router in ROUTERS:
            dynamo = dynamo_replay(*counts[name], router)
            if dynamo is not None:
                runs[f"{name}/dynamo {router}"] = dynamo
    rates: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(repeats):  # interleaved, so a busy moment hits every run alike
        for key, run in runs.items():
            rates[key].append(timed(run))
    median = {key: statistics.median(values) for key, values in rates.items()}

    print(f"  {'configuration':<14} {'P/D':>6} {'sim req/s':>15} {'dynamo rr':>10} {'dynamo kv':>10}  ratio")
    figures: dict[str, Any] = {"requests": len(read_workload(TRACE)), "repeats": repeats}
    for name in CONFIGS:
        prefill, decode = counts[name]
        ours = median[name]
        theirs = {router: median.get(f"{name}/dynamo {router}") for router in ROUTERS}
        shown = [f"{v:10.0f}" if v is not None else f"{'-':>10}" for v in theirs.values()]
        best = max((v for v in theirs.values() if v is not None), default=None)
        ratio = f"{ours / best:.2f}x" if best else "(no dynamo)"
        print(f"  {name:<14} {f'{prefill}/{decode}':>6} {ours:15.0f} {' '.join(shown)}  {ratio}")
        figures[f"{name}_req_per_s"] = round(ours, 1)
        for router, value in theirs.items():
            if value is not None:
                figures[f"{name}_dynamo_{router}_req_per_s"] = round(value, 1)
        if best:
            figures[f"{name}_vs_dynamo"] = round(ours / best, 3)
    if not any(key.endswith("_vs_dynamo") for key in figures):
        print("  dynamo is not installed: only the minifaas rows (see the module docstring)")
    if args.json:
        print(json.dumps({"bench": "sim_replay", **figures}))


if __name__ == "__main__":
    main()
