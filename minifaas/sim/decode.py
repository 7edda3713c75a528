"""The PD-D instances: continuous batching with at most BS_max running requests each.

Decode runs at the SLO's step time whatever the batch (the profile's
``step_time_s`` is the time per step at BS_max), so a request holds one batch
slot for output_tokens steps and its first token comes one step after it
joins. A request whose KV arrives at a full instance waits for a slot there.
The router picks the instance when the request arrives (least assigned work,
counting requests still in prefill or on the link), as the live router does.
Loads move by one at a time, so instances sit in buckets by load and the least
loaded is found in O(1), not by scanning hundreds of instances per request.
A ``retire``d instance leaves the buckets (it gets no new requests) and
finishes its batch; ``add_node`` appends one.
"""

from __future__ import annotations

from collections import deque

from minifaas.planner.profile import DecodeProfile
from minifaas.policy.router import NodeView


class DecodeInstances:
    def __init__(self, profile: DecodeProfile, n: int) -> None:
        self.profile = profile
        self.ids = [f"pd-d-{i}" for i in range(n)]
        self.index = {node_id: i for i, node_id in enumerate(self.ids)}
        self.assigned = [0] * n  # routed here and not finished
        self.running = [0] * n
        self.waiting: list[deque[int]] = [deque() for _ in range(n)]
        self.total_running = 0
        self.total_waiting = 0
        self._buckets: list[dict[int, None]] = [dict.fromkeys(range(n))]  # load -> instances (insertion-ordered)
        self._min_load = 0
        self.retired: set[int] = set()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def serving(self) -> int:
        return len(self.ids) - len(self.retired)

    def least_loaded(self) -> int | None:
        if not self.serving:
            return None
        return next(iter(self._buckets[self._min_load]))

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
        node = self.least_loaded()
        return () if node is None else (NodeView(self.ids[node], 0, float(self.assigned[node])),)

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
        """A request left the batch; returns the waiting request that takes its slot, if any.
        (A retired instance is empty once ``assigned[node]`` is 0 after this.)"""
        self._move(node, -1)
        if self.waiting[node]:
            self.total_waiting -= 1
            return self.waiting[node].popleft()
        self.running[node] -= 1
        self.total_running -= 1
        return None
