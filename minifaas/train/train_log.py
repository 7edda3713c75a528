"""The training log: one JSON object a line (step, tokens, losses, rate), and a PNG of its loss curve."""

from __future__ import annotations

import json
from pathlib import Path

LOG_FILE = "training_log.jsonl"
PLOT_FILE = "loss_curve.png"


class TrainLog:
    """Rows of ``out/training_log.jsonl``. A resumed run first drops rows past the step it resumes
    from (written after its last save), so each step appears once and in order."""

    def __init__(self, out: Path, resume_step: int | None) -> None:
        self.path = out / LOG_FILE
        kept = [r for r in read_log(self.path) if r["step"] <= resume_step] if resume_step is not None else []
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def read_log(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(rows: list[dict], path: Path, title: str) -> bool:
    """Train and validation loss over tokens seen; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [(r["tokens"], r["train_loss"]) for r in rows if "train_loss" in r]
    val = [(r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for points, label in ((train, "train"), (val, "validation")):
        if points:
            ax.plot(*zip(*points), label=label, marker="o" if label == "validation" else None, markersize=3)
    ax.set_xlabel("tokens (bytes) seen")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
