"""A recorded trace as the simulator replays it: ``minifaas.traces`` (shared with the planner) read into a Workload."""

from __future__ import annotations

from pathlib import Path

from minifaas import traces
from minifaas.sim.workload import Workload


def read_workload(name_or_path: str | Path, length_scale: float = 1.0, rate_scale: float = 1.0) -> Workload:
    """A shipped trace by name (``minifaas.traces.SHIPPED_TRACES``) or a trace file, as a Workload."""
    t = traces.read_trace(name_or_path, length_scale, rate_scale)
    return Workload(t.name, t.arrival_s, t.input_tokens, t.output_tokens, t.hash_ids, t.block_tokens)
