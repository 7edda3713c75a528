"""Chaos: a real gateway under steady mixed load while its workers and link emulator are killed and stopped.

The benchmark's own run (benchmarks/bench_chaos.py --quick --json, a fixed seed), in its own process
(forked from the pre-loaded interpreter, ``python`` in conftest.py):
seeded SIGKILLs and SIGSTOP/SIGCONTs of every worker role and the emulator, one at a time. Every
request must complete with generate()'s greedy tokens or fail with a clear, counted error; none may
outlive the bound its deadlines allow; every process the gateway ever started must be gone after
shutdown, and every process that was faulted must have come back into routing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from preloaded import Preloaded

ROOT = Path(__file__).resolve().parent.parent
# what a failure may say: the codes of the gateway's OpenAI error bodies (minifaas.gateway.api.api_error)
CLEAN_CAUSES = {"request_failed", "timeout", "overloaded", "migration_limit"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_under_kills_and_stops_every_request_is_right_or_cleanly_failed_and_nothing_hangs_or_stays(
    python: Preloaded,
) -> None:
    cmd = ["benchmarks/bench_chaos.py", "--quick", "--json", "--calm-s", "5", "--chaos-s", "40"]
    done = python.run(cmd, cwd=ROOT, env=dict(os.environ), timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    chaos, faults = result["chaos"], result["faults"]
    print(json.dumps({k: result[k] for k in ("chaos", "faults", "load_average")}))
    assert chaos["sent"] >= 20 and len(faults) >= 5, result
    assert chaos["wrong"] == 0 and chaos["hung"] == 0, result
    assert chaos["ok"] + chaos["failed"] == chaos["sent"], result
    assert set(chaos["failed_by_cause"]) <= CLEAN_CAUSES, result
    assert {f["signal"] for f in faults} == {"SIGKILL", "SIGSTOP"}, faults
    assert all(f["recover_s"] is not None for f in faults if f["signal"] == "SIGKILL"), faults
    assert result["processes_left"] == [], result
    assert result["calm"]["wrong"] == result["calm"]["failed"] == 0, result
