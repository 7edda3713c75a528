"""The PrfaaS throughput model (the paper's eqs 2-6, listed in docs/ARCHITECTURE.md), vectorised over thresholds.

A stage that receives no requests (p = 0 or p = 1) does not bound Lambda. ``expected_latency`` prices each side
by E[T(L)] instead of T(E[L]): a queue's capacity is one over its mean service time, which the paper's form
overstates when T is convex.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from minifaas.planner.case import PlanCase


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """One configuration's solution; ``None`` marks what does not apply to it."""

    config: str
    threshold_tokens: float | None
    n_prfaas: int
    n_prefill: int
    n_decode: int
    offload_fraction: float
    l_long: float | None
    l_short: float | None
    theta_prfaas: float | None  # req/s the PrfaaS cluster can prefill (and ship)
    theta_pdp: float | None  # req/s the PD-P nodes can prefill
    theta_pdd: float  # req/s the PD-D nodes can decode
    throughput_rps: float  # Lambda_max
    egress_gbps: float | None  # PrfaaS egress at Lambda_max
    link_gbps: float | None
    bottleneck: str

    def to_dict(self) -> dict[str, object]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def stages(
    case: PlanCase, thresholds: np.ndarray, n_prfaas: int, n_prefill: int, n_decode: int, expected_latency: bool = False
) -> dict[str, np.ndarray]:
    """Eqs 3-6 for every threshold; arrays of the same shape as ``thresholds``."""
    t = np.asarray(thresholds, dtype=float)
    p, l_long, l_short = case.lengths.split(t)
    safe_long = np.where(np.isnan(l_long), 1.0, l_long)
    safe_short = np.where(np.isnan(l_short), 1.0, l_short)
    if expected_latency:
        values = case.lengths.values
        t_long, _ = case.lengths.conditional_means(case.prfaas.latency_s(values), t)
        _, t_short = case.lengths.conditional_means(case.pd_prefill.latency_s(values), t)
        t_long, t_short = np.where(np.isnan(t_long), 1.0, t_long), np.where(np.isnan(t_short), 1.0, t_short)
    else:
        t_long, t_short = case.prfaas.latency_s(safe_long), case.pd_prefill.latency_s(safe_short)
    compute = n_prfaas / t_long
    transfer = case.link_bytes_per_s / case.prfaas.kv_bytes(safe_long)
    theta_prfaas = np.minimum(compute, transfer)
    theta_pdp = n_prefill / t_short
    theta_pdd = np.full_like(t, n_decode * case.decode.requests_per_s(case.output_tokens))
    with np.errstate(divide="ignore"):
        bound_prfaas = np.where(p > 0, theta_prfaas / np.where(p > 0, p, 1.0), np.inf)
        bound_pdp = np.where(p < 1, theta_pdp / np.where(p < 1, 1.0 - p, 1.0), np.inf)
    lam = np.minimum(np.minimum(bound_prfaas, bound_pdp), theta_pdd)
    egress_gbps = lam * p * case.prfaas.kv_bytes(safe_long) * 8 / 1e9
    return {
        "p": p,
        "l_long": l_long,
        "l_short": l_short,
        "compute": compute,
        "transfer": transfer,
        "theta_prfaas": theta_prfaas,
        "theta_pdp": theta_pdp,
        "theta_pdd": theta_pdd,
        "bound_prfaas": bound_prfaas,
        "bound_pdp": bound_pdp,
        "lambda": lam,
        "egress_gbps": egress_gbps,
    }


def bottleneck_of(row: dict[str, float]) -> str:
    """Which of eq 6's terms sets Lambda_max (the transfer cap is named when it binds eq 3)."""
    lam = row["lambda"]
    if math.isclose(row["bound_prfaas"], lam, rel_tol=1e-9):
        return "prfaas-link" if row["transfer"] < row["compute"] else "prfaas-compute"
    if math.isclose(row["bound_pdp"], lam, rel_tol=1e-9):
        return "pd-prefill"
    return "pd-decode"


def operating_point(
    config: str,
    case: PlanCase,
    threshold: float | None,
    n_prfaas: int,
    n_prefill: int,
    n_decode: int,
    expected_latency: bool = False,
) -> OperatingPoint:
    """Eqs 3-6 at one configuration. ``threshold=None`` means no threshold: every prefill goes
    to PrfaaS when ``n_prefill == 0``, to PD-P otherwise."""
    no_threshold = -1.0 if n_prefill == 0 else float(case.lengths.values[-1])
    t = no_threshold if threshold is None else float(threshold)
    arrays = stages(case, np.array([t]), n_prfaas, n_prefill, n_decode, expected_latency)
    row = {k: float(v[0]) for k, v in arrays.items()}
    offloads = row["p"] > 0
    return OperatingPoint(
        config=config,
        threshold_tokens=threshold,
        n_prfaas=n_prfaas,
        n_prefill=n_prefill,
        n_decode=n_decode,
        offload_fraction=row["p"],
        l_long=row["l_long"] if offloads else None,
        l_short=row["l_short"] if row["p"] < 1 else None,
        theta_prfaas=row["theta_prfaas"] if n_prfaas and offloads else None,
        theta_pdp=row["theta_pdp"] if n_prefill else None,
        theta_pdd=row["theta_pdd"],
        throughput_rps=row["lambda"],
        egress_gbps=row["egress_gbps"] if offloads else None,
        link_gbps=case.link_gbps if n_prfaas else None,
        bottleneck=bottleneck_of(row),
    )
