"""The planner's search: the best threshold and PD split, and the two baselines priced by the same model.

``best_prfaas`` sweeps a grid of t and every N_p for the most Lambda_max; ties (a decode-bound plateau) go to
eq 7's balance, then to the least egress, which leaves the most link headroom. ``naive`` sends every prefill to
the PrfaaS cluster; ``best_homogeneous`` has no PrfaaS cluster at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minifaas.planner.case import PlanCase
from minifaas.planner.model import OperatingPoint, operating_point, stages


@dataclass(frozen=True, slots=True)
class SearchGrid:
    threshold_step: int = 100
    threshold_max: int | None = None  # default: the largest length in the distribution

    def __post_init__(self) -> None:
        if self.threshold_step < 1:
            raise ValueError("threshold_step must be >= 1")

    def thresholds(self, case: PlanCase) -> np.ndarray:
        top = self.threshold_max if self.threshold_max is not None else float(case.lengths.values[-1])
        return np.arange(0.0, top + self.threshold_step, self.threshold_step)


@dataclass(frozen=True, slots=True)
class Plan:
    prfaas: OperatingPoint
    homogeneous: OperatingPoint
    naive: OperatingPoint

    def to_dict(self) -> dict[str, dict[str, object]]:
        return {name: getattr(self, name).to_dict() for name in ("prfaas", "homogeneous", "naive")}

    @property
    def gain_vs_homogeneous(self) -> float:
        return _gain(self.prfaas.throughput_rps, self.homogeneous.throughput_rps)

    @property
    def gain_vs_naive(self) -> float:
        """PrfaaS's throughput over naive's, less 1; inf where naive serves nothing (no PrfaaS instance)."""
        return _gain(self.prfaas.throughput_rps, self.naive.throughput_rps)


def _gain(ours: float, theirs: float) -> float:
    return ours / theirs - 1 if theirs else math.inf if ours else math.nan


def best_prfaas(case: PlanCase, grid: SearchGrid = SearchGrid(), expected_latency: bool = False) -> OperatingPoint:
    thresholds = grid.thresholds(case)
    best_key: tuple[float, float, float] | None = None
    best: tuple[float, int] = (0.0, 0)
    for n_prefill in range(case.n_pd):
        s = stages(case, thresholds, case.n_prfaas, n_prefill, case.n_pd - n_prefill, expected_latency)
        with np.errstate(invalid="ignore", divide="ignore"):
            imbalance = np.abs(s["bound_prfaas"] - s["bound_pdp"]) / s["lambda"]
        imbalance = np.where(np.isfinite(imbalance), imbalance, np.inf)
        # lexicographic: most throughput (to 1e-9), then best balance, then least egress
        order = np.lexsort((s["egress_gbps"], imbalance, -np.round(s["lambda"], 9)))
        i = int(order[0])
        key = (-round(float(s["lambda"][i]), 9), float(imbalance[i]), float(s["egress_gbps"][i]))
        if best_key is None or key < best_key:
            best_key, best = key, (float(thresholds[i]), n_prefill)
    threshold, n_prefill = best
    n_decode = case.n_pd - n_prefill
    return operating_point("prfaas", case, threshold, case.n_prfaas, n_prefill, n_decode, expected_latency)


def best_homogeneous(case: PlanCase, expected_latency: bool = False) -> OperatingPoint:
    n = case.n_homogeneous
    points = [operating_point("homogeneous", case, None, 0, p, n - p, expected_latency) for p in range(1, n)]
    return max(points, key=lambda op: op.throughput_rps)


def naive(case: PlanCase, expected_latency: bool = False) -> OperatingPoint:
    return operating_point("naive", case, None, case.n_prfaas, 0, case.n_pd, expected_latency)


def plan(case: PlanCase, grid: SearchGrid = SearchGrid(), expected_latency: bool = False) -> Plan:
    return Plan(
        prfaas=best_prfaas(case, grid, expected_latency),
        homogeneous=best_homogeneous(case, expected_latency),
        naive=naive(case, expected_latency),
    )
