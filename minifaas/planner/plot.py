"""The two pictures a reader of a plan needs (matplotlib, the optional ``plot`` extra): eq 6's bounds against N_p
at the chosen t, which cross at eq 8, and the two prefill bounds as t sweeps, which cross at eq 7."""

from __future__ import annotations

import numpy as np

from minifaas.planner.case import PlanCase
from minifaas.planner.model import stages
from minifaas.planner.search import Plan, SearchGrid


def plot_plan(case: PlanCase, result: Plan, grid: SearchGrid, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = result.prfaas
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))

    n_prefill = np.arange(case.n_pd)
    rows = [
        stages(case, np.array([best.threshold_tokens]), case.n_prfaas, int(n), case.n_pd - int(n)) for n in n_prefill
    ]
    for key, label in (("bound_prfaas", "PrfaaS  Θ_prfaas / p"), ("bound_pdp", "PD-P  Θ_pdp / (1-p)")):
        left.plot(n_prefill, [float(r[key][0]) for r in rows], marker="o", label=label)
    left.plot(n_prefill, [float(r["theta_pdd"][0]) for r in rows], marker="o", label="PD-D  Θ_pdd")
    left.plot(n_prefill, [float(r["lambda"][0]) for r in rows], "k--", label="Λ_max")
    left.set(xlabel="N_p  (N_d = N - N_p)", ylabel="req/s", title=f"bounds vs N_p at t = {best.threshold_tokens:.0f}")
    left.set_ylim(0, 2.0 * max(best.throughput_rps, 1e-9))
    left.legend(fontsize=8)

    thresholds = grid.thresholds(case)
    s = stages(case, thresholds, case.n_prfaas, best.n_prefill, best.n_decode)
    right.plot(thresholds / 1000, s["bound_prfaas"], label="PrfaaS  Θ_prfaas / p")
    right.plot(thresholds / 1000, s["bound_pdp"], label="PD-P  Θ_pdp / (1-p)")
    right.plot(thresholds / 1000, s["lambda"], "k--", label="Λ_max")
    right.axvline(best.threshold_tokens / 1000, color="grey", lw=0.8)
    right.set(xlabel="threshold t (K tokens)", ylabel="req/s", title=f"bounds vs t at N_p = {best.n_prefill}")
    right.set_ylim(0, 2.0 * best.throughput_rps)
    right.set_xscale("log")
    right.legend(fontsize=8)

    fig.suptitle(f"{case.name}: best {best.throughput_rps:.2f} req/s, p = {best.offload_fraction:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
