"""A cluster's prefill instances: one FCFS queue of forwards each, one forward at a time, timed by the profile.

A forward's start and end are worked out when it is placed; the node takes its next forward a turnaround after
a forward ends (the worker's own time between forwards). On a shared host ``rescale`` stretches or shrinks what a
node has left when the workers computing beside it change, and bumps each forward's ``version`` so the
simulator's events for the old times go stale. A lazy heap finds the node that frees up first; its entries go
stale when a node's ``busy_until`` moves and are dropped at the top. A ``retire``d node takes no new work and
finishes what it holds.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from minifaas.planner.profile import PrefillProfile
from minifaas.policy.router import NodeView


@dataclass(slots=True)
class Forward:
    """One prefill forward of a node: its requests, and cold prompts of its length that join it until it starts."""

    start: float
    end: float
    length: int  # each prompt's (0: one that takes no riders)
    tokens: int
    slowdown: float
    requests: list[int]
    version: int = 0  # bumped whenever start or end moves
    started: bool = False

    def takes(self, now: float, tokens: int, budget: int) -> bool:
        """Whether a cold prompt of ``tokens`` may ride: the forward has not begun, its prompts are that long,
        and the budget holds them all."""
        return self.start > now and self.length == tokens and self.tokens + tokens <= budget


class PrefillInstances:
    def __init__(
        self, cluster: str, node_prefix: str, profile: PrefillProfile, n: int, batch_tokens: int = 0,
        turnaround_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.cluster = cluster
        self.batch_tokens = batch_tokens  # a forward's budget for prompts of one length (0: one prompt each)
        self.turnaround_s = turnaround_s  # after each forward, at the profile's speed, before the node takes another
        self.queue: list[deque[Forward]] = [deque() for _ in range(n)]  # placed and not ended, the first running
        self.profile = profile
        self.ids = [f"{node_prefix}-{i}" for i in range(n)]
        self.index = {node_id: i for i, node_id in enumerate(self.ids)}
        self.busy_until = [0.0] * n  # when the node may start its next forward: its last one's end and turnaround
        self.queued_tokens = [0] * n
        self.in_system = 0  # requests placed here whose prefill has not ended
        self.in_node = [0] * n
        self.retired: set[int] = set()
        self.busy_s = 0.0  # node-seconds of the forwards and turnarounds placed, those still to come included
        self._heap = [(0.0, i) for i in range(n)]
        self._coeffs = profile.latency_coeffs
        self.kv_fixed_bytes = float(profile.kv_bytes(0))
        self._kv_per_token = profile.kv_bytes_per_token  # None: interpolate the table

    def kv_bytes(self, tokens: int, fixed: bool = True) -> float:
        """Bytes shipped for ``tokens`` of full-attention KV, plus the fixed-size state if ``fixed``."""
        if self._kv_per_token is not None:
            growing = self._kv_per_token * tokens
        else:
            growing = float(self.profile.kv_bytes(tokens)) - self.kv_fixed_bytes
        return growing + (self.kv_fixed_bytes if fixed else 0.0)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def serving(self) -> int:
        return len(self.ids) - len(self.retired)

    def wait_s(self, now: float) -> float:
        """How long a prefill arriving now would wait for the first free node."""
        free = self.first_free()
        return 0.0 if free is None else max(0.0, self.busy_until[free] - now)

    def retire(self, node: int) -> None:
        self.retired.add(node)

    def add_node(self, node_id: str, now: float) -> int:
        node = len(self.ids)
        self.ids.append(node_id)
        self.index[node_id] = node
        self.busy_until.append(now)
        self.queue.append(deque())
        self.queued_tokens.append(0)
        self.in_node.append(0)
        heapq.heappush(self._heap, (now, node))
        return node

    def latency_s(self, tokens: int) -> float:
        """T_prefill(tokens); Horner's rule in plain floats on the hot path."""
        if not self._coeffs:
            return float(self.profile.latency_s(tokens))
        total = 0.0
        for c in reversed(self._coeffs):
            total = total * tokens + c
        return total

    def first_free(self) -> int | None:
        heap = self._heap
        while heap and (heap[0][0] != self.busy_until[heap[0][1]] or heap[0][1] in self.retired):
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def views(self, hits: dict[int, int]) -> tuple[NodeView, ...]:
        """Router candidates: the first-free node plus every node holding a prefix (the router could pick no other)."""
        free = self.first_free()
        if not hits:  # the common case, kept cheap: one candidate
            return () if free is None else (NodeView(self.ids[free], 0, float(self.queued_tokens[free])),)
        nodes = set(hits) | ({free} if free is not None else set())
        return tuple(NodeView(self.ids[i], hits.get(i, 0), float(self.queued_tokens[i])) for i in sorted(nodes))

    def busy(self) -> int:
        """Nodes with a forward placed and not ended: the workers this pool has computing."""
        return sum(1 for queue in self.queue if queue)

    def _free_after(self, forward: Forward) -> float:
        return forward.end + self.turnaround_s * forward.slowdown

    def place(self, node: int, now: float, tokens: int, request: int, cold: bool = False) -> Forward:
        """Queue a prefill of ``tokens`` uncached tokens for ``request``, at the node's current slowdown; the
        forward it is in. A ``cold`` prompt (no cached prefix) may join the node's last forward, which then ends
        later for all."""
        queue = self.queue[node]
        self.queued_tokens[node] += tokens
        self.in_system += 1
        self.in_node[node] += 1
        last = queue[-1] if queue else None
        if cold and last is not None and self.batch_tokens and last.takes(now, tokens, self.batch_tokens):
            last.tokens += tokens
            last.end = last.start + self.latency_s(last.tokens) * last.slowdown
            last.version += 1
            last.requests.append(request)
            free = self._free_after(last)
            self.busy_s += free - self.busy_until[node]
            self.busy_until[node] = free
            heapq.heappush(self._heap, (free, node))
            return last
        slowdown = last.slowdown if last is not None else 1.0  # the node's speed now (idle: the profile's)
        start = max(now, self.busy_until[node])  # FCFS, one turnaround after the last forward
        duration = self.latency_s(max(tokens, 1)) * slowdown
        forward = Forward(start, start + duration, tokens if cold else 0, tokens, slowdown, [request])
        queue.append(forward)
        turnaround = self.turnaround_s * slowdown
        free = forward.end + turnaround
        self.busy_s += duration + turnaround
        self.busy_until[node] = free
        heapq.heappush(self._heap, (free, node))
        return forward

    def rescale(self, node: int, now: float, slowdown: float) -> deque[Forward]:
        """The node computes at ``slowdown`` from now on: what its forwards have left takes that much over the
        profile's time (processor sharing). Returns its forwards, each with a new ``version``."""
        queue = self.queue[node]
        if not queue or queue[-1].slowdown == slowdown:
            return deque()
        ratio = slowdown / queue[-1].slowdown
        for forward in queue:
            if forward.start > now:
                forward.start = now + (forward.start - now) * ratio
            forward.end = now + (forward.end - now) * ratio
            forward.slowdown = slowdown
            forward.version += 1
        free = self._free_after(queue[-1])
        self.busy_s += free - self.busy_until[node]
        self.busy_until[node] = free
        heapq.heappush(self._heap, (free, node))
        return queue

    def busy_by(self, end: float) -> float:
        """Node-seconds computing (forwards and turnarounds) up to ``end``, taken no earlier than the last event:
        what was placed, less what is still to come after ``end`` (a node busy then is busy until its
        ``busy_until``)."""
        return self.busy_s - sum(max(0.0, until - end) for until in self.busy_until)

    def ended(self, node: int) -> None:
        """The node's running forward ended (``done`` then counts each of its requests)."""
        self.queue[node].popleft()

    def done(self, node: int, tokens: int) -> bool:
        """A prefill ended; True if that emptied a retired node (it can change role now)."""
        self.queued_tokens[node] -= tokens
        self.in_system -= 1
        self.in_node[node] -= 1
        return node in self.retired and not self.in_node[node]
