"""A routing policy of one's own: simulated against the built-in router on a trace, then served live.

``LeastLoadedRouter`` ignores the threshold: each request is prefilled on the node, in either cluster, that
would finish it first (its queued tokens plus the prompt's uncached ones, over the cluster's relative speed,
``prfaas_speedup``), and decoded on the least loaded decode node. It implements ``RoutingPolicy``
(minifaas/policy/interfaces.py): one ``route`` from a ``RouteInput`` to a ``RouteDecision``. The planned
PrfaaS deployment replays the first 1,500 requests of the shipped Mooncake trace once with each router; the
table and custom_router.png compare TTFT p50/p90, throughput and link use. The same class serves live,
unchanged (from the project root, where ``examples`` is importable; docs/POLICIES.md):

    python examples/custom_router.py [TRACE.jsonl]   # default: the Mooncake trace in data/traces
    minifaas serve --router examples.custom_router:LeastLoadedRouter --router-arg prfaas_speedup=2
"""

from __future__ import annotations

import sys
from dataclasses import replace

from minifaas.planner import LengthDistribution, plan
from minifaas.planner.paper import paper_case
from minifaas.policy.router import ClusterView, NodeView, Path, RouteDecision, RouteInput, RouteReason
from minifaas.sim import config_for, read_workload
from minifaas.sim.comparison import COLUMNS, cells, compare, plot_comparison
from minifaas.sim.report import SimResult

REQUESTS, PLOT = 1500, "custom_router.png"


class LeastLoadedRouter:
    def __init__(self, prfaas_speedup: float = 2.0) -> None:
        self.prfaas_speedup = prfaas_speedup  # a PrfaaS node's prefill speed over a PD-P node's

    def route(self, request: RouteInput) -> RouteDecision:
        clusters = (request.prfaas, request.pd) if request.link_up else (request.pd,)
        options = [(c, n) for c in clusters for n in c.prefill_nodes if n.healthy]
        decoders = [n for n in request.pd.decode_nodes if n.healthy]
        if not options or not decoders:
            reason = RouteReason.NO_PREFILL_NODE if decoders else RouteReason.NO_DECODE_NODE
            return RouteDecision(Path.REJECT, reason, request.prompt_tokens)
        cluster, node = min(options, key=lambda o: (self._finish(request, *o), o[1].node_id))
        decode = min(decoders, key=lambda n: (n.load, n.node_id))
        offload = cluster is request.prfaas
        held = min(max(request.pd.kv_prefix_tokens, decode.hit_tokens), request.prompt_tokens)  # need not cross
        path, reason = (Path.PRFAAS, RouteReason.LONG) if offload else (Path.PD, RouteReason.SHORT)
        return RouteDecision(
            path, reason, request.prompt_tokens, node.node_id, decode.node_id, _hit(cluster, node),
            decode_kv_tokens=held,
        )  # fmt: skip

    def _finish(self, request: RouteInput, cluster: ClusterView, node: NodeView) -> float:
        work = node.load + request.prompt_tokens - _hit(cluster, node)
        return work / (self.prfaas_speedup if cluster is request.prfaas else 1.0)


def _hit(cluster: ClusterView, node: NodeView) -> int:
    return max(node.hit_tokens, cluster.pool_hit_tokens)


def text_table(results: dict[str, SimResult]) -> str:
    width = max(len("policy"), *(len(name) for name in results))
    lines = [f"{'policy':<{width}}" + "".join(f"{header:>15}" for header, _, _ in COLUMNS)]
    lines += [f"{name:<{width}}" + "".join(f"{c:>15}" for c in cells(r)) for name, r in results.items()]
    return "\n".join(lines)


def main() -> None:
    trace = read_workload(sys.argv[1] if len(sys.argv) > 1 else "mooncake-synthetic")
    workload = trace.head(REQUESTS)
    case = paper_case().with_overrides(lengths=LengthDistribution.empirical("mooncake", trace.input_tokens))
    planned = config_for(case, plan(case).prfaas)
    ours = f"{__name__}:LeastLoadedRouter"  # loaded by name, as `minifaas serve --router` loads it
    configs = {
        "built-in": planned,
        "least-loaded": replace(planned, router_policy=ours, router_args={"prfaas_speedup": 2.0}),
    }
    results = compare(configs, workload)
    print(f"{workload.name}: {len(workload)} requests, {planned.n_prfaas} PrfaaS + {planned.n_prefill} PD-P "
          f"+ {planned.n_decode} PD-D instances, threshold {planned.threshold} tokens")  # fmt: skip
    print(text_table(results))
    plot_comparison(results, PLOT)
    built_in, least = results["built-in"], results["least-loaded"]
    print(f"least-loaded offloads {least.offload_fraction:.0%} of prompts (built-in {built_in.offload_fraction:.0%}), "
          f"egress {least.egress_gbps_mean / built_in.egress_gbps_mean:.2f}x; plot: {PLOT}")  # fmt: skip


if __name__ == "__main__":
    main()
