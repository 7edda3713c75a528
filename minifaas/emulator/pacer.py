"""The link emulator's policy, free of I/O: rate pacing, rate schedules, delay with jitter, flow windows.

``Pacer`` is a token bucket written as a virtual clock: n bytes reserved at time t leave at max(t, previous
departure) + 8n/R, and oversleeping is forgiven up to ``burst_bytes``, so the average rate stays exact when the
event loop wakes late. One Pacer shared by every flow is an aggregate link; one per flow is a per-flow cap.
``FlowWindow`` holds a flow to window / RTT, as TCP does over a long link (the relay ends TCP on loopback).
"""

from __future__ import annotations

import random
import re
from collections import deque
from dataclasses import dataclass

_RATE = re.compile(r"^\s*([0-9.]+(?:e[0-9]+)?)\s*([kmg]?)(?:bit|bps|b)?(?:/s)?\s*$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text: str) -> float | None:
    """'100mbit', '5gbit', '2.5e8' -> bits/s; 'none' or 'inf' -> None (unlimited)."""
    if text.strip().lower() in ("none", "inf", "unlimited"):
        return None
    m = _RATE.match(text)
    if m is None:
        raise ValueError(f"not a rate: {text!r} (try 100mbit, 5gbit, 2.5e8)")
    bps = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if bps <= 0:
        raise ValueError(f"a rate must be positive, got {text!r} (none: unlimited)")
    return bps


_BYTES = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(|b|kb|mb|gb|kib|mib|gib)\s*$", re.IGNORECASE)
_BYTE_SCALE = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
MIN_WINDOW_BYTES = 1500  # one full-size segment: a window can always carry a packet


def parse_bytes(text: str) -> int | None:
    """'262144', '256KiB', '4MiB', '64KB' -> bytes; 'none' -> None (unlimited)."""
    if text.strip().lower() in ("none", "inf", "unlimited"):
        return None
    m = _BYTES.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (try 262144, 256KiB, 4MiB)")
    return int(float(m.group(1)) * _BYTE_SCALE[m.group(2).lower()])


def check_window(window_bytes: object) -> int | None:
    """A flow window as given (None: unlimited); ValueError unless a whole number of bytes >= one segment."""
    if window_bytes is None:
        return None
    if isinstance(window_bytes, bool) or not isinstance(window_bytes, int) or window_bytes < MIN_WINDOW_BYTES:
        raise ValueError(f"a flow window must be a whole number of bytes >= {MIN_WINDOW_BYTES}, got {window_bytes!r}")
    return window_bytes


class FlowWindow:
    """One flow's bytes in flight, one direction: sent and not yet acknowledged."""

    def __init__(self, window_bytes: int | None) -> None:
        self.window_bytes = check_window(window_bytes)
        self.in_flight = 0
        self._acks: deque[tuple[float, int]] = deque()  # (acknowledged at, bytes), in sending order

    def set_window(self, window_bytes: int | None) -> None:
        self.window_bytes = check_window(window_bytes)

    def room(self, now: float) -> int | None:
        """Bytes the flow may send now (None: no window); acknowledgements due by ``now`` are taken in."""
        acks = self._acks
        while acks and acks[0][0] <= now:
            self.in_flight -= acks.popleft()[1]
        return None if self.window_bytes is None else max(0, self.window_bytes - self.in_flight)

    def next_ack(self) -> float | None:
        """When the oldest bytes in flight are acknowledged (None: nothing in flight)."""
        return self._acks[0][0] if self._acks else None

    def sent(self, nbytes: int, acked_at: float) -> None:
        """``nbytes`` left; their acknowledgement is back at ``acked_at``. Counted with no window too, so
        a window set mid-flow starts from what is really in flight."""
        self.in_flight += nbytes
        self._acks.append((acked_at, nbytes))


class Pacer:
    def __init__(self, rate_bps: float | None, burst_seconds: float = 0.02, min_burst_bytes: int = 1500):
        self.burst_seconds = burst_seconds
        self.min_burst_bytes = min_burst_bytes
        self.rate_bps = rate_bps
        self._next_free = float("-inf")  # idle since forever: a full burst is available

    def set_rate(self, rate_bps: float | None) -> None:
        if rate_bps is not None and rate_bps <= 0:
            raise ValueError("a rate must be positive (None: unlimited)")
        self.rate_bps = rate_bps

    @property
    def burst_bytes(self) -> float:
        return 0.0 if self.rate_bps is None else max(self.min_burst_bytes, self.rate_bps / 8 * self.burst_seconds)

    def reserve(self, nbytes: int, now: float) -> float:
        """Book ``nbytes`` on the link; returns how long to wait until they have left it."""
        if self.rate_bps is None:
            return 0.0
        bytes_per_s = self.rate_bps / 8
        start = max(self._next_free, now - self.burst_bytes / bytes_per_s)
        self._next_free = start + nbytes / bytes_per_s
        return max(0.0, self._next_free - now)


@dataclass(frozen=True, slots=True)
class RateSchedule:
    """Rate steps ``(seconds after start, bits/s or None)``, sorted; the last one holds forever."""

    steps: tuple[tuple[float, float | None], ...]

    def __post_init__(self) -> None:
        times = [t for t, _ in self.steps]
        if times != sorted(times) or any(t < 0 for t in times):
            raise ValueError(f"schedule times must be >= 0 and sorted: {times}")

    @classmethod
    def parse(cls, text: str) -> RateSchedule:
        """'0:1gbit,5:100mbit,8:1gbit' -> steps."""
        steps = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            at, _, rate = part.partition(":")
            steps.append((float(at), parse_rate(rate)))
        return cls(tuple(steps))


class DelayLine:
    """One-way delay with jitter that never reorders a flow's bytes (TCP would not see reordering)."""

    def __init__(self, rng: random.Random):
        self._rng = rng
        self._last = 0.0

    def release_time(self, now: float, delay_s: float, jitter_s: float) -> float:
        jitter = self._rng.uniform(-jitter_s, jitter_s) if jitter_s else 0.0
        self._last = max(self._last, now + max(0.0, delay_s + jitter))
        return self._last
