"""The simulator's results on the Mooncake trace, pinned: a faster simulator must simulate the same thing.

Each case replays the whole trace (3,993 requests with prefix hashes) through
``minifaas sim``'s own ``build`` and ``Simulation``. The digest covers every
request's path, first-token and finish time (the raw float64 bytes), the queue
samples and the scheduler's trace, so any change to what is simulated, down to
the last bit of one time, changes it; the headline figures beside it make a
failure readable. The figures were recorded from the simulator before its hot
paths (prefix matching, the pools' bookkeeping, the event loop) were optimised.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import numpy as np
import pytest

from minifaas.commands import sim as sim_cli
from minifaas.sim.simulator import Simulation

TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake_synthetic_trace.jsonl"

CASES = {  # name -> extra ``minifaas sim`` flags
    "homogeneous": ["--config", "homogeneous"],
    "prfaas": ["--config", "prfaas"],
    "naive": ["--config", "naive"],
    "prfaas-abundant": ["--config", "prfaas", "--rule", "abundant", "--threshold", "4000"],
    "prfaas-scheduler": ["--config", "prfaas", "--scheduler", "--rate-scale", "2"],
    "prfaas-small-cache": ["--config", "prfaas", "--cache-gb", "20"],
    "prfaas-no-pipelining": ["--config", "prfaas", "--pipeline-layers", "0", "--no-prefix-cache"],
}

PINNED = {  # name -> (TTFT p90 s, prefix hit ratio, offload fraction, egress Gbps mean, digest)
    "homogeneous": (3.325984, 0.594842, 0.0, 0.0, "9bc82389bd4c7b45"),
    "prfaas": (4.14287, 0.596516, 0.305785, 3.586461, "4e7c8d639531f7f3"),
    "naive": (1.545429, 0.596449, 1.0, 8.505135, "e7d5267eb367f52c"),
    "prfaas-abundant": (2.099937, 0.596449, 0.239669, 4.537332, "fc6a847fac776799"),
    "prfaas-scheduler": (267.662295, 0.570813, 0.338342, 7.824094, "8e45c95410c5990c"),
    "prfaas-small-cache": (47.742144, 0.060308, 0.306787, 7.144719, "0ad94eba82f1d967"),
    "prfaas-no-pipelining": (58.962326, 0.0, 0.306787, 7.626585, "af74fd42c530d284"),
}


def replay(extra: list[str]) -> tuple[tuple[float, float, float, float], str]:
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    config, workload, _ = sim_cli.build(parser.parse_args(["--case", "paper", "--trace", str(TRACE), *extra]))
    simulation = Simulation(config, workload)
    result = simulation.run()
    digest = hashlib.sha256()
    for column in (
        np.array(simulation.path, dtype=np.int64),
        np.array(simulation.first_token),
        np.array(simulation.finished),
        result.queues,
        result.schedule,
    ):
        digest.update(np.ascontiguousarray(column).tobytes())
    r = result
    figures = (r.ttft_p90_s, r.prefix_hit_token_ratio, r.offload_fraction, r.egress_gbps_mean)
    return tuple(round(f, 6) for f in figures), digest.hexdigest()[:16]  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(CASES))
def test_the_trace_replays_to_the_pinned_results(name: str) -> None:
    figures, digest = replay(CASES[name])
    assert (*figures, digest) == PINNED[name]
