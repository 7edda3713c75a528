"""The inter-cluster link as one fluid pipe its flows share equally (processor sharing), with RTT and a changing rate.

A virtual clock V counts the bytes each active flow has received and advances at B(t)/n; a flow of S bytes that
starts at V0 is done when V reaches V0 + S, so flows sit in a heap by V0 + S and only the head decides the next
completion, whatever B or n do later. The simulator adds each flow's one-way delay and pipelined tail itself.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class LinkConfig:
    gbps: float = 100.0
    rtt_s: float = 0.0
    pipeline_layers: int = 0  # layers streamed during prefill; 0 = send after prefill ends
    schedule: tuple[tuple[float, float], ...] = ()  # (from time s, Gbps) changes; e.g. ((600, 20), (900, 100))

    def __post_init__(self) -> None:
        if self.gbps < 0 or self.rtt_s < 0 or self.pipeline_layers < 0:
            raise ValueError(f"bad link config {self}")
        times = [t for t, _ in self.schedule]
        if times != sorted(times) or any(g < 0 for _, g in self.schedule):
            raise ValueError("schedule must be sorted by time with bandwidths >= 0")

    @property
    def one_way_s(self) -> float:
        return self.rtt_s / 2


class FluidLink:
    """Flows in bytes, time in seconds; ``bins_s``-wide bins record delivered bytes (egress over time)."""

    def __init__(self, gbps: float, bins_s: float = 1.0) -> None:
        self.bytes_per_s = gbps * 1e9 / 8
        self.bins_s = bins_s
        self._virtual = 0.0
        self._last = 0.0
        self._flows: list[tuple[float, int]] = []  # (virtual finish, flow id)
        self.delivered = np.zeros(64)
        self.capacity_bytes = 0.0  # integral of B(t) dt: the denominator of utilisation
        self.busy_s = 0.0
        self.sent_bytes = 0.0  # delivered so far, all flows

    @property
    def active(self) -> int:
        return len(self._flows)

    def share_bytes_per_s(self) -> float:
        return self.bytes_per_s / max(1, len(self._flows))

    def advance(self, now: float) -> None:
        dt = now - self._last
        if dt <= 0:
            return
        self.capacity_bytes += self.bytes_per_s * dt
        n = len(self._flows)
        if n:
            self._virtual += self.bytes_per_s / n * dt
            self.busy_s += dt
            self.sent_bytes += self.bytes_per_s * dt
            self._record(self._last, now)
        self._last = now

    def _record(self, start: float, end: float) -> None:
        first, last = int(start // self.bins_s), int(end // self.bins_s)
        if last >= self.delivered.size:
            self.delivered = np.concatenate((self.delivered, np.zeros(max(last + 1, 2 * self.delivered.size))))
        if first == last:
            self.delivered[first] += self.bytes_per_s * (end - start)
            return
        self.delivered[first] += self.bytes_per_s * ((first + 1) * self.bins_s - start)
        self.delivered[first + 1 : last] += self.bytes_per_s * self.bins_s
        self.delivered[last] += self.bytes_per_s * (end - last * self.bins_s)

    def add(self, now: float, flow_id: int, size_bytes: float) -> None:
        self.advance(now)
        heapq.heappush(self._flows, (self._virtual + size_bytes, flow_id))

    def set_bandwidth(self, now: float, gbps: float) -> None:
        self.advance(now)
        self.bytes_per_s = gbps * 1e9 / 8

    def backlog_bytes(self) -> float:
        """Bytes still to deliver, over every active flow."""
        return sum(finish - self._virtual for finish, _ in self._flows)

    def next_completion(self) -> float:
        """Time the head flow finishes if nothing changes; inf when idle or cut."""
        if not self._flows or self.bytes_per_s <= 0:
            return math.inf
        remaining = max(0.0, self._flows[0][0] - self._virtual)
        return self._last + remaining * len(self._flows) / self.bytes_per_s

    def pop_done(self, now: float) -> list[int]:
        """Flows done by ``now``, by their ids: their bytes all sent, up to float error in the virtual clock, or
        so few left that the time they need rounds to ``now`` (a clock of large times moves in coarse steps)."""
        self.advance(now)
        done = []
        # a relative tolerance absorbs float error in the virtual clock
        while self._flows and (
            self._flows[0][0] <= self._virtual * (1 + 1e-12) + 1e-6 or self.next_completion() <= self._last
        ):
            done.append(heapq.heappop(self._flows)[1])
        return done

    def egress_gbps(self, until_s: float) -> np.ndarray:
        """Delivered Gbps in each full bin up to ``until_s``."""
        bins = max(1, int(until_s // self.bins_s))
        out = np.zeros(bins)
        have = min(bins, self.delivered.size)
        out[:have] = self.delivered[:have]
        return out * 8 / 1e9 / self.bins_s
