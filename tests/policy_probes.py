"""Policies the plug-in tests name by ``module:Class`` (this folder is on the tests' path): each records what
it was shown, so a test can compare what the gateway and the simulator gave it."""

from __future__ import annotations

from minifaas.policy.router import Path, RouteDecision, RouteInput, RouteReason


class OneCluster:
    """Every request prefilled in ``cluster`` (prfaas or pd), whatever its length, on its least loaded node."""

    def __init__(self, cluster: str) -> None:
        if cluster not in ("prfaas", "pd"):
            raise ValueError(f"cluster must be prfaas or pd, got {cluster!r}")
        self.cluster = cluster
        self.seen: list[RouteInput] = []

    def route(self, request: RouteInput) -> RouteDecision:
        self.seen.append(request)
        view = request.prfaas if self.cluster == "prfaas" else request.pd
        node = min((n for n in view.prefill_nodes if n.healthy), key=lambda n: (n.load, n.node_id))
        decode = min((n for n in request.pd.decode_nodes if n.healthy), key=lambda n: (n.load, n.node_id))
        path, reason = (Path.PRFAAS, RouteReason.LONG) if self.cluster == "prfaas" else (Path.PD, RouteReason.SHORT)
        cached = max(node.hit_tokens, view.pool_hit_tokens)
        return RouteDecision(path, reason, request.prompt_tokens, node.node_id, decode.node_id, cached)
