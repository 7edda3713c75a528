"""Policies side by side: one deployment and one workload simulated once per policy, as a table and a plot."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from minifaas.sim.deployment import SimConfig
from minifaas.sim.report import SimResult
from minifaas.sim.simulator import Simulation
from minifaas.sim.workload import Workload

# (header, SimResult field, format)
COLUMNS = (
    ("req/s", "throughput_rps", ".3f"),
    ("TTFT p50 s", "ttft_p50_s", ".2f"),
    ("TTFT p90 s", "ttft_p90_s", ".2f"),
    ("offloaded", "offload_fraction", ".1%"),
    ("prefix hit", "prefix_hit_token_ratio", ".1%"),
    ("egress Gbit/s", "egress_gbps_mean", ".2f"),
    ("link busy", "link_utilisation", ".1%"),
)


def compare(
    configs: Mapping[str, SimConfig], workload: Workload, progress: Callable[[str, float], None] | None = None
) -> dict[str, SimResult]:
    """Each config's result on ``workload``, by name; ``progress(name, simulated seconds)`` as each runs."""
    results = {}
    for name, config in configs.items():
        tick = None if progress is None else (lambda now, name=name: progress(name, now))
        results[name] = Simulation(config, workload).run(progress=tick)
    return results


def cells(result: SimResult) -> list[str]:
    return [format(getattr(result, field), spec) for _, field, spec in COLUMNS]


def plot_comparison(results: Mapping[str, SimResult], path: str | Path) -> None:
    """TTFT p50 and p90, throughput and the link's use per policy (needs matplotlib, the plot extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    x = range(len(names))
    fig, (ttft, rate, link) = plt.subplots(1, 3, figsize=(11, 3.6))
    ttft.bar([i - 0.2 for i in x], [r.ttft_p50_s for r in results.values()], 0.4, label="p50")
    ttft.bar([i + 0.2 for i in x], [r.ttft_p90_s for r in results.values()], 0.4, label="p90")
    ttft.set(title="TTFT", ylabel="seconds")
    ttft.margins(y=0.25)
    ttft.legend(fontsize=8, ncols=2, loc="upper left")
    rate.bar(x, [r.throughput_rps for r in results.values()], 0.6)
    rate.set(title="throughput", ylabel="requests/s")
    link.bar(x, [r.egress_gbps_mean for r in results.values()], 0.6)
    link.set(title="link use (mean egress)", ylabel="Gbit/s")
    for ax in (ttft, rate, link):
        ax.set_xticks(list(x), names, rotation=15, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
