"""The simulator's results on the Mooncake trace, pinned: a faster simulator must simulate the same thing.

Each case replays the whole trace (3,993 requests with prefix hashes) through
``minifaas sim``'s own ``build`` and ``Simulation``, and is compared with the
reference in ``tests/data/sim_replay.json.gz``. What the simulator decides must
match exactly: each request's path, its prefill and decode node, the order in
which requests got their first token and finished, the number of events, the
queue counts and the scheduler's thresholds and role counts. Times and the
headline figures must match to ``RTOL``: float rounding differs in the last bits
between CPUs and library builds, and the test must pass on any of them.

``python tests/test_sim_replay.py`` writes the reference from the simulator as
it is, for a change that means to simulate something else.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from minifaas.commands import sim as sim_cli
from minifaas.sim.simulator import Simulation

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
REFERENCE = ROOT / "tests" / "data" / "sim_replay.json.gz"

# Far above the last-bit differences between machines (a few ulps, 1e-16 relative), far below a
# change a simulation could make, and below the smallest relative gap between two requests' times
# in these runs (6e-9), so times within it cannot reorder the requests.
RTOL = 1e-9

CASES = {  # name -> extra ``minifaas sim`` flags
    "homogeneous": ["--config", "homogeneous"],
    "prfaas": ["--config", "prfaas"],
    "naive": ["--config", "naive"],
    "prfaas-abundant": ["--config", "prfaas", "--rule", "abundant", "--threshold", "4000"],
    "prfaas-scheduler": ["--config", "prfaas", "--scheduler", "--rate-scale", "2"],
    "prfaas-small-cache": ["--config", "prfaas", "--cache-gb", "20"],
    "prfaas-no-pipelining": ["--config", "prfaas", "--pipeline-layers", "0", "--no-prefix-cache"],
}
FIGURES = ("ttft_p90_s", "prefix_hit_token_ratio", "offload_fraction", "egress_gbps_mean")


def replay(extra: list[str]) -> dict[str, Any]:
    """One case's run: decisions as ints, times as floats (None where a request never got there)."""
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    config, workload, _ = sim_cli.build(parser.parse_args(["--case", "paper", "--trace", str(TRACE), *extra]))
    simulation = Simulation(config, workload)
    result = simulation.run()
    return {
        "figures": {name: getattr(result, name) for name in FIGURES},
        "events": result.events,
        "path": simulation.path,
        "prefill_node": simulation.prefill_node,
        "decode_node": simulation.decode_node,
        "first_token": [None if math.isnan(t) else t for t in simulation.first_token],
        "finished": [None if math.isnan(t) else t for t in simulation.finished],
        "queue_times": result.queues[:, 0].tolist(),
        "queue_counts": result.queues[:, 1:].astype(int).tolist(),  # PrfaaS, PD-P, link flows, decode waiting, running
        "schedule_times": result.schedule[:, 0].tolist(),
        "schedule": result.schedule[:, 1:].astype(int).tolist(),  # threshold, PD-P serving, PD-D serving
    }


def times(values: list[float | None]) -> np.ndarray:
    return np.array([math.nan if v is None else v for v in values])


def order(values: list[float | None]) -> list[int]:
    """Requests in the order they reached a time (ties in request order); those that never did are left out."""
    t = times(values)
    return [int(i) for i in np.argsort(t, kind="stable") if not math.isnan(t[i])]


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, Any]]:
    with gzip.open(REFERENCE, "rt") as f:
        return json.load(f)


@pytest.mark.parametrize("name", list(CASES))
def test_the_trace_replays_to_the_reference(name: str, reference: dict[str, dict[str, Any]]) -> None:
    got, want = replay(CASES[name]), reference[name]
    for decided in ("path", "prefill_node", "decode_node", "queue_counts", "schedule"):
        assert got[decided] == want[decided], f"{decided} differs"
    for reached in ("first_token", "finished"):
        assert order(got[reached]) == order(want[reached]), f"the order of {reached} differs"
    assert got["events"] == want["events"]
    for timed in ("first_token", "finished", "queue_times", "schedule_times"):
        np.testing.assert_allclose(times(got[timed]), times(want[timed]), rtol=RTOL, atol=0, err_msg=timed)
    for figure in FIGURES:
        assert got["figures"][figure] == pytest.approx(want["figures"][figure], rel=RTOL, nan_ok=True), figure


if __name__ == "__main__":
    REFERENCE.parent.mkdir(exist_ok=True)
    text = json.dumps({name: replay(extra) for name, extra in CASES.items()}, separators=(",", ":"))
    with gzip.GzipFile(REFERENCE, "wb", compresslevel=9, mtime=0) as out:  # the same bytes for the same results
        out.write(text.encode())
    print(f"wrote {REFERENCE}")
