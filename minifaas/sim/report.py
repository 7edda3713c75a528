"""What a simulation reports: throughput, TTFT, offload, prefix hits, egress, link use, queues over time."""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

QUEUE_COLUMNS = ("time_s", "prfaas_prefill", "pd_prefill", "link_flows", "decode_waiting", "decode_running")
SCHEDULE_COLUMNS = ("time_s", "threshold", "pd_prefill_workers", "pd_decode_workers")


@dataclass(frozen=True)
class SimResult:
    requests: int
    completed: int
    rejected: int
    window_s: float  # the span throughput and egress are measured over: [warmup, last arrival]
    throughput_rps: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_prfaas_mean_s: float
    ttft_pd_mean_s: float
    tpot_s: float
    offload_fraction: float
    prefix_hit_token_ratio: float
    egress_gbps_mean: float
    egress_gbps_p99: float
    link_utilisation: float
    prfaas_prefill_utilisation: float
    pd_prefill_utilisation: float
    events: int
    queues: np.ndarray = field(repr=False)  # rows of QUEUE_COLUMNS
    threshold_final: int = 0
    threshold_max: int = 0
    threshold_changes: int = 0  # ticks on which the scheduler moved t
    role_conversions: int = 0  # PD workers that changed role and rejoined
    n_prefill_final: int = 0  # PD workers prefilling at the end, after any role conversions
    n_decode_final: int = 0  # PD workers decoding at the end
    kv_coded_fraction: float = 0.0  # PrfaaS transfers the compression policy coded
    kv_wire_ratio: float = 1.0  # PrfaaS state bytes over the bytes they put on the link
    schedule: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)), repr=False)  # rows of SCHEDULE_COLUMNS

    def to_dict(self) -> dict[str, float | int | None]:
        """The figures; None where there was nothing to measure (no request took the PD prefill path)."""
        out = asdict(self)
        out.pop("queues")
        out.pop("schedule")
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}

    def write_queues_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(QUEUE_COLUMNS)
            writer.writerows(self.queues.tolist())

    def plot_queues(self, path: str | Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 3.5))
        for i, name in enumerate(QUEUE_COLUMNS[1:], start=1):
            ax.plot(self.queues[:, 0], self.queues[:, i], label=name, lw=1)
        ax.set(xlabel="time (s)", ylabel="requests", title="queue depths")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else float("nan")
