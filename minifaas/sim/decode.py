"""The PD-D instances: continuous batching with at most BS_max running requests each.

A request is assigned an instance as it arrives and holds a batch slot for its output steps once its KV is there,
waiting while the batch is full. Assigned loads move by one at a time, so instances sit in buckets by load and the
least loaded is found at once. With ``by_batch`` a step's time follows the rows running (``BatchClock``) and the
longest of them, the rows being padded to it.
"""

from __future__ import annotations

import heapq
from collections import deque

from minifaas.planner.profile import DecodeProfile
from minifaas.policy.router import NodeView


class BatchClock:
    """One instance's count of steps taken, at a rate that changes with its rows, and the count each request
    leaves at; ``due`` is when the next leaves at the current rate."""

    def __init__(self) -> None:
        self.steps = 0.0
        self.at = 0.0
        self.step_s = 0.0  # seconds per step since ``at`` (0: no rows)
        self.busy = 1.0  # the share of a step spent computing (the rest: the hold)
        self.leaving: list[tuple[float, int]] = []  # (steps at which it leaves, request)
        self.generation = 0  # the ``due`` event that is current
        self.rows: set[int] = set()  # the requests decoding
        self.longest: list[tuple[int, int]] = []  # (-length, request), a max-heap; rows gone are dropped as met

    def width(self) -> int:
        """The longest row's length, the width every row is padded to."""
        while self.longest and self.longest[0][1] not in self.rows:
            heapq.heappop(self.longest)
        return -self.longest[0][0] if self.longest else 0

    def advance(self, now: float) -> None:
        if self.step_s:
            self.steps += (now - self.at) / self.step_s
        self.at = now

    def due(self) -> float:
        return self.at + (self.leaving[0][0] - self.steps) * self.step_s


class DecodeInstances:
    def __init__(
        self, profile: DecodeProfile, n: int, by_batch: bool = False, hold: float = 0.0, hold_max_s: float = 0.0
    ) -> None:
        self.profile = profile
        self.hold, self.hold_max_s = hold, hold_max_s
        self.ids = [f"pd-d-{i}" for i in range(n)]
        self.index = {node_id: i for i, node_id in enumerate(self.ids)}
        self.assigned = [0] * n  # routed here and not finished
        self.running = [0] * n
        self.waiting: list[deque[int]] = [deque() for _ in range(n)]
        self.total_running = self.total_waiting = 0
        self._buckets: list[dict[int, None]] = [dict.fromkeys(range(n))]  # load -> instances (insertion-ordered)
        self._min_load = 0
        self.retired: set[int] = set()
        self.clocks = [BatchClock() for _ in range(n)] if by_batch else []

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def serving(self) -> int:
        return len(self.ids) - len(self.retired)

    def retire(self, node: int) -> bool:
        """Take the instance out of routing; True if it is already empty."""
        self.retired.add(node)
        del self._buckets[self.assigned[node]][node]
        self._settle_min()
        return not self.assigned[node]

    def add_node(self, node_id: str) -> int:
        node = len(self.ids)
        self.ids.append(node_id)
        self.index[node_id] = node
        self.assigned.append(0)
        self.running.append(0)
        self.waiting.append(deque())
        if self.clocks:
            self.clocks.append(BatchClock())
        self._buckets[0][node] = None
        self._min_load = 0
        return node

    def _settle_min(self) -> None:
        if not self.serving:
            return
        while self._min_load < len(self._buckets) - 1 and not self._buckets[self._min_load]:
            self._min_load += 1

    def views(self) -> tuple[NodeView, ...]:
        """The least-loaded instance only: with no affinity the router picks the least load."""
        if not self.serving:
            return ()
        node = next(iter(self._buckets[self._min_load]))
        return (NodeView(self.ids[node], 0, float(self.assigned[node])),)

    def _move(self, node: int, delta: int) -> None:
        old = self.assigned[node]
        new = old + delta
        self.assigned[node] = new
        if node in self.retired:
            return
        del self._buckets[old][node]
        if new == len(self._buckets):
            self._buckets.append({})
        self._buckets[new][node] = None
        if new < self._min_load:
            self._min_load = new
        self._settle_min()

    def reserve(self, node: int) -> None:
        self._move(node, +1)

    def arrive(self, node: int, request: int) -> bool:
        """The request's KV is here; True if it joins the batch now, False if it waits."""
        if self.running[node] < self.profile.bs_max:
            self.running[node] += 1
            self.total_running += 1
            return True
        self.waiting[node].append(request)
        self.total_waiting += 1
        return False

    def finish(self, node: int) -> int | None:
        """A request left the batch; returns the waiting request that takes its slot, if any."""
        self._move(node, -1)
        if self.waiting[node]:
            self.total_waiting -= 1
            return self.waiting[node].popleft()
        self.running[node] -= 1
        self.total_running -= 1
        return None

    def join(self, node: int, request: int, steps: int, now: float, tokens: int = 0) -> None:
        """(``by_batch``) The request, counted in ``running`` already, decodes ``steps`` steps from now, its row
        ``tokens`` long (it grows by one a step: halfway through, it holds ``tokens + steps // 2``)."""
        clock = self.clocks[node]
        clock.advance(now)
        heapq.heappush(clock.leaving, (clock.steps + steps, request))
        clock.rows.add(request)
        heapq.heappush(clock.longest, (-(tokens + steps // 2), request))

    def leave(self, node: int, now: float) -> int:
        """(``by_batch``) Remove and return the clock's next request to finish; ``finish`` frees its slot."""
        clock = self.clocks[node]
        clock.advance(now)
        clock.steps, request = heapq.heappop(clock.leaving)
        clock.rows.remove(request)
        return request

    def restep(self, node: int, slowdown: float = 1.0) -> BatchClock:
        """(``by_batch``) Set the clock's step time for the rows running now and the longest of them, ``slowdown``
        times the profile's, plus the hold while more requests are on their way than the instance holds."""
        clock = self.clocks[node]
        rows = self.running[node]
        step = self.profile.step_s(rows, clock.width() + 1) * slowdown if rows else 0.0
        held = rows + len(self.waiting[node])
        wait = min(self.hold * step, self.hold_max_s) if self.hold and self.assigned[node] - held > held else 0.0
        clock.step_s = step + wait
        clock.busy = step / clock.step_s if wait else 1.0
        return clock

    def computing(self) -> float:
        """The instances stepping now, each counted by the share of its steps it computes."""
        if not self.clocks:
            return float(sum(1 for rows in self.running if rows))
        return sum(clock.busy for clock, rows in zip(self.clocks, self.running, strict=True) if rows)
