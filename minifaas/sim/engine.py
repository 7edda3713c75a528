"""The discrete-event engine: a clock and a heap of (time, seq, callback, argument).

``seq`` breaks time ties in scheduling order, so a run is deterministic. Arrivals, known in advance, come from a
sorted ``feed`` merged into the loop rather than the heap; at equal times they go after scheduled events.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Handler = Callable[[Any], None]


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Handler, Any]] = []
        self._seq = 0
        self.events = 0
        self._feed: list[float] = []
        self._feed_handler: Handler | None = None

    def feed(self, times: list[float], handler: Handler) -> None:
        """Call ``handler(i)`` at ``times[i]`` for every i (``times`` sorted)."""
        self._feed, self._feed_handler = times, handler

    def at(self, time: float, handler: Handler, arg: Any = None) -> None:
        if time < self.now:
            raise ValueError(f"event at {time} is in the past (now {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, handler, arg))

    def __len__(self) -> int:
        return len(self._heap)

    def run(
        self, until: float = float("inf"), tick: Callable[[float], None] | None = None, every: int = 50_000
    ) -> None:
        """Fire events in time order up to ``until``; ``tick(now)`` every ``every`` events (progress)."""
        heap, pop = self._heap, heapq.heappop
        feed, feed_handler, next_feed = self._feed, self._feed_handler, 0
        fed = len(feed)
        fired = 0
        while True:
            if next_feed < fed and (not heap or feed[next_feed] < heap[0][0]):
                if feed[next_feed] > until:
                    break
                self.now = feed[next_feed]
                next_feed += 1
                feed_handler(next_feed - 1)  # type: ignore[misc]
            elif heap and heap[0][0] <= until:
                time, _, handler, arg = pop(heap)
                self.now = time
                handler(arg)
            else:
                break
            fired += 1
            if tick is not None and fired % every == 0:
                tick(time)
        self.events += fired
        if until != float("inf"):
            self.now = max(self.now, until)
