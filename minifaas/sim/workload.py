"""A workload, held as numpy columns: when requests arrive, their prompt and output lengths, the blocks they share.

``hash_ids`` is there only for traces that carry prefix information: one id per ``block_tokens`` block, equal
leading ids meaning a shared prefix. A workload is drawn (``synthetic``) or a recorded trace, read by
``minifaas.traces`` (shared with the planner); a trace with a request longer than a model's context, or arrivals
spread over more than a month, is refused (``check_bounds``) rather than simulated for years of simulated time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minifaas import traces
from minifaas.planner.lengths import LengthDistribution
from minifaas.sim.arrivals import ArrivalSpec, arrival_times

MAX_REQUEST_TOKENS = 10_000_000  # a prompt and its output together: past the context a model holds
MAX_SPAN_S = 31 * 86_400.0  # arrivals a trace may span: a month, which simulates in seconds


@dataclass(frozen=True)
class Workload:
    name: str
    arrival_s: np.ndarray  # float64, sorted
    input_tokens: np.ndarray  # int64, >= 1
    output_tokens: np.ndarray  # int64, >= 1
    hash_ids: tuple[tuple[int, ...], ...] | None = None
    block_tokens: int = 512

    def __post_init__(self) -> None:
        n = self.arrival_s.size
        if self.input_tokens.size != n or self.output_tokens.size != n:
            raise ValueError(f"{self.name}: columns differ in length")
        if n and (np.any(np.diff(self.arrival_s) < 0) or self.input_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise ValueError(f"{self.name}: arrivals must be sorted and lengths >= 1")
        if self.hash_ids is not None and len(self.hash_ids) != n:
            raise ValueError(f"{self.name}: one hash id list per request")
        if self.block_tokens < 1:
            raise ValueError(f"{self.name}: block_tokens must be >= 1")

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    @property
    def rate(self) -> float:
        return len(self) / self.duration_s if self.duration_s > 0 else 0.0

    def check_bounds(self) -> None:
        """Refuse a request longer than ``MAX_REQUEST_TOKENS`` or arrivals spanning more than ``MAX_SPAN_S``: a
        simulation of either would work through years of simulated time, one sample a second."""
        tokens = self.input_tokens.astype(float) + self.output_tokens
        if np.any(tokens > MAX_REQUEST_TOKENS):
            count = int(np.count_nonzero(tokens > MAX_REQUEST_TOKENS))
            raise ValueError(f"{self.name}: {count} request(s) with {_TOO_LONG} (the longest {tokens.max():,.0f})")
        if self.duration_s > MAX_SPAN_S:
            days, most = self.duration_s / 86_400, MAX_SPAN_S / 86_400
            raise ValueError(f"{self.name}: arrivals span {days:,.0f} days, more than the {most:g} days a run may "
                             "simulate (a stray timestamp?)")  # fmt: skip

    def head(self, n: int) -> Workload:
        ids = self.hash_ids[:n] if self.hash_ids is not None else None
        return Workload(
            self.name, self.arrival_s[:n], self.input_tokens[:n], self.output_tokens[:n], ids, self.block_tokens
        )


def synthetic(
    lengths: LengthDistribution, output_tokens: int, arrivals: ArrivalSpec, duration_s: float, seed: int = 0
) -> Workload:
    """Requests with independent lengths drawn from ``lengths``, a fixed output length,
    no prefix sharing, arriving by ``arrivals`` over ``duration_s`` seconds."""
    rng = np.random.default_rng(seed)
    times = arrival_times(arrivals, duration_s, rng)
    inputs = lengths.sample(rng, times.size)
    outputs = np.full(times.size, output_tokens, dtype=np.int64)
    return Workload(f"{lengths.name}, {arrivals.describe()}", times, inputs, outputs)


_TOO_LONG = f"more than {MAX_REQUEST_TOKENS:,} tokens of prompt and output, past a model's context"


def read_workload(name_or_path: str | Path, length_scale: float = 1.0, rate_scale: float = 1.0) -> Workload:
    """A shipped trace by name (``minifaas.traces.SHIPPED_TRACES``) or a trace file, as a Workload; a length too
    large for an int64 is refused as too long (``Workload.check_bounds`` refuses the rest past the bounds)."""
    try:
        with np.errstate(invalid="raise"):  # an error, not a warning and a wrapped length
            t = traces.read_trace(name_or_path, length_scale, rate_scale)
    except (FloatingPointError, OverflowError):
        raise ValueError(f"{Path(name_or_path).name}: a request with {_TOO_LONG}") from None
    return Workload(t.name, t.arrival_s, t.input_tokens, t.output_tokens, t.hash_ids, t.block_tokens)
