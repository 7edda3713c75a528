"""The training text as bytes: a train/validation split and the batches of each step.

Batches depend only on (seed, step), so a resumed run draws exactly the windows an uninterrupted one would;
validation uses the same held-out windows every time, so its loss curve compares like with like.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

TEXTS_DIR = Path(__file__).resolve().parents[2] / "data" / "text"


def shipped_texts() -> list[str]:
    return sorted(p.stem for p in TEXTS_DIR.glob("*.txt"))


def text_path(name_or_path: str | Path) -> Path:
    """A shipped text by name (data/text/<name>.txt), or the path given; FileNotFoundError names the shipped ones."""
    if str(name_or_path) in shipped_texts():
        return TEXTS_DIR / f"{name_or_path}.txt"
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no text {str(name_or_path)!r}: not a shipped text ({', '.join(shipped_texts())}) "
                                "or a file")  # fmt: skip
    return path


class TextData:
    def __init__(self, name_or_path: str | Path, val_fraction: float, seq_len: int) -> None:
        self.path = text_path(name_or_path)
        raw = self.path.read_bytes()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        split = int(len(raw) * (1 - val_fraction))
        for name, part in (("training", raw[:split]), ("validation", raw[split:])):
            if len(part) < seq_len + 2:  # a window of seq_len + 1 bytes, at one start or more
                raise ValueError(f"{self.path}: {len(part)} {name} bytes, fewer than the {seq_len + 2} a window needs")
        self.train = torch.frombuffer(bytearray(raw[:split]), dtype=torch.uint8)
        self.val = torch.frombuffer(bytearray(raw[split:]), dtype=torch.uint8)
        self.seq_len = seq_len

    def batch(self, seed: int, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets [batch, seq_len] for ``step``: random windows of the training bytes."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (batch_size,), generator=gen)
        return self._windows(self.train, starts)

    def val_batches(self, count: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``count`` batches of held-out windows spread evenly over the validation bytes."""
        last = len(self.val) - self.seq_len - 1
        starts = torch.linspace(0, last, count * batch_size).long()
        return [self._windows(self.val, starts[i * batch_size : (i + 1) * batch_size]) for i in range(count)]

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([data[s : s + self.seq_len + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]
