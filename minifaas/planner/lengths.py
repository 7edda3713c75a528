"""Uncached input-length distributions, as weighted samples the planner can condition on.

Each is sorted support points with probabilities: a truncated log-normal at equal-probability quantiles, or the
lengths observed. The planner's conditional means then need only prefix sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True)
class LengthDistribution:
    name: str
    values: np.ndarray  # sorted lengths in tokens
    probs: np.ndarray  # same shape, sums to 1
    _cum_p: np.ndarray = field(init=False, repr=False)
    _cum_pl: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.values.ndim != 1 or self.values.shape != self.probs.shape or self.values.size == 0:
            raise ValueError(f"{self.name}: values and probs must be equal-length, non-empty 1-D arrays")
        if np.any(np.diff(self.values) < 0) or np.any(self.probs < 0):
            raise ValueError(f"{self.name}: values must be sorted and probs non-negative")
        if not math.isclose(float(self.probs.sum()), 1.0, rel_tol=1e-9):
            raise ValueError(f"{self.name}: probs must sum to 1")
        # prefix sums with a leading zero: index k covers values[:k]
        object.__setattr__(self, "_cum_p", np.concatenate(([0.0], np.cumsum(self.probs))))
        object.__setattr__(self, "_cum_pl", np.concatenate(([0.0], np.cumsum(self.probs * self.values))))

    @classmethod
    def lognormal(cls, mu: float, sigma: float, low: float, high: float, points: int = 20_000) -> LengthDistribution:
        if sigma <= 0 or not 0 < low < high or points < 2:
            raise ValueError("need sigma > 0, 0 < low < high and points >= 2")
        normal = NormalDist()
        lo, hi = normal.cdf((math.log(low) - mu) / sigma), normal.cdf((math.log(high) - mu) / sigma)
        quantiles = lo + (np.arange(points) + 0.5) / points * (hi - lo)
        z = np.array([normal.inv_cdf(float(q)) for q in quantiles])
        values = np.exp(mu + sigma * z)
        name = f"lognormal(mu={mu}, sigma={sigma}) in [{low:g}, {high:g}]"
        return cls(name, values, np.full(points, 1.0 / points))

    @classmethod
    def empirical(cls, name: str, lengths: np.ndarray | list[int]) -> LengthDistribution:
        values = np.sort(np.asarray(lengths, dtype=float))
        if values.size == 0:
            raise ValueError(f"{name}: no lengths")
        return cls(name, values, np.full(values.size, 1.0 / values.size))

    @property
    def mean(self) -> float:
        return float(self._cum_pl[-1])

    def split(self, thresholds: np.ndarray | float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each threshold t: p = P(L > t), l_long = E[L | L > t], l_short = E[L | L <= t].

        An empty side's conditional mean is NaN (no request goes there)."""
        t = np.asarray(thresholds, dtype=float)
        k = np.searchsorted(self.values, t, side="right")  # values[:k] <= t
        total = self._cum_p[-1]  # 1 up to rounding; dividing by it makes p exactly 0 or 1 at the ends
        p_short, pl_short = self._cum_p[k] / total, self._cum_pl[k] / total
        p_long, pl_long = (total - self._cum_p[k]) / total, (self._cum_pl[-1] - self._cum_pl[k]) / total
        with np.errstate(invalid="ignore", divide="ignore"):
            l_long = np.where(p_long > 1e-12, pl_long / np.where(p_long > 1e-12, p_long, 1.0), np.nan)
            l_short = np.where(p_short > 1e-12, pl_short / np.where(p_short > 1e-12, p_short, 1.0), np.nan)
        return p_long, l_long, l_short

    def conditional_means(self, f_values: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """E[f(L) | L > t] and E[f(L) | L <= t] for each t, given f at every support point (NaN if empty)."""
        t = np.asarray(thresholds, dtype=float)
        k = np.searchsorted(self.values, t, side="right")
        cum_pf = np.concatenate(([0.0], np.cumsum(self.probs * f_values)))
        p_short, p_long = self._cum_p[k], self._cum_p[-1] - self._cum_p[k]
        with np.errstate(invalid="ignore", divide="ignore"):
            long = np.where(p_long > 1e-12, (cum_pf[-1] - cum_pf[k]) / np.where(p_long > 1e-12, p_long, 1.0), np.nan)
            short = np.where(p_short > 1e-12, cum_pf[k] / np.where(p_short > 1e-12, p_short, 1.0), np.nan)
        return long, short

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` integer lengths drawn from the distribution."""
        picks = rng.choice(self.values.size, size=n, p=self.probs)
        return np.maximum(1, np.rint(self.values[picks])).astype(np.int64)
