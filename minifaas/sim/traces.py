"""A recorded trace as the simulator replays it: ``minifaas.traces`` read into a ``Workload``.

The readers live in ``minifaas.traces`` because the planner reads traces too
(their prompt lengths) and must not depend on the simulator.
"""

from __future__ import annotations

from pathlib import Path

from minifaas import traces
from minifaas.sim.workload import Workload
from minifaas.traces import SHARED_TRACES

__all__ = ["SHARED_TRACES", "read_trace"]  # the simulator's callers find the traces here too


def read_trace(path: str | Path, length_scale: float = 1.0, rate_scale: float = 1.0) -> Workload:
    t = traces.read_trace(path, length_scale, rate_scale)
    return Workload(t.name, t.arrival_s, t.input_tokens, t.output_tokens, t.hash_ids, t.block_tokens)
