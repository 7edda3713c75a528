"""Arrival processes: uniform, Poisson and bursty (a two-state Markov-modulated Poisson process).

Bursty traffic alternates exponential ON and OFF periods (means ``on_s``, ``off_s``); the OFF rate is
``off_fraction`` of the ON rate, and both are set so the long-run mean is ``rate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np


class ArrivalKind(StrEnum):
    UNIFORM = "uniform"
    POISSON = "poisson"
    BURSTY = "bursty"


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    kind: ArrivalKind
    rate: float  # mean requests per second
    on_s: float = 10.0
    off_s: float = 10.0
    off_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.on_s <= 0 or self.off_s <= 0 or not 0 <= self.off_fraction <= 1:
            raise ValueError(f"bad arrival spec {self}")

    @property
    def on_rate(self) -> float:
        on_share = self.on_s / (self.on_s + self.off_s)
        return self.rate / (on_share + (1 - on_share) * self.off_fraction)

    def describe(self) -> str:
        if self.kind is ArrivalKind.BURSTY:
            return f"bursty {self.rate:g}/s (on {self.on_s:g}s at {self.on_rate:.3g}/s, off {self.off_s:g}s)"
        return f"{self.kind.value} {self.rate:g}/s"


def arrival_times(spec: ArrivalSpec, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted arrival times in [0, duration_s)."""
    if spec.kind is ArrivalKind.UNIFORM:
        return np.arange(0.0, duration_s, 1.0 / spec.rate)
    if spec.kind is ArrivalKind.POISSON:
        return _poisson(spec.rate, 0.0, duration_s, rng)
    chunks = []
    t, on = 0.0, bool(rng.random() < spec.on_s / (spec.on_s + spec.off_s))
    while t < duration_s:
        length = rng.exponential(spec.on_s if on else spec.off_s)
        rate = spec.on_rate if on else spec.on_rate * spec.off_fraction
        end = min(t + length, duration_s)
        if rate > 0:
            chunks.append(_poisson(rate, t, end, rng))
        t, on = end, not on
    return np.concatenate(chunks) if chunks else np.empty(0)


def _poisson(rate: float, start: float, end: float, rng: np.random.Generator) -> np.ndarray:
    count = rng.poisson(rate * (end - start))
    return np.sort(rng.uniform(start, end, count))
