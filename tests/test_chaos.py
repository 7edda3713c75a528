"""Chaos: real servers under concurrent streamed greedy load over HTTP while their child processes are killed
and stopped.

The benchmark's own runs (benchmarks/bench_chaos.py --quick --json, a fixed seed), each in its own
process (forked from the pre-loaded interpreter, ``python`` in conftest.py) driving ``minifaas serve``
through its OpenAI API. With two workers per role, ten faults in clusters (every process of one kind within
a few seconds: both decode workers together among them); with one, five faults one at a time, one of each
kind (PD-P, PrfaaS and PD-D workers, a link emulator, the pre-loaded parent). Every stream's token ids are
compared with transformers' own generate().

- Two workers per role: every request is served, token for token; none fails, hangs or is cut.
- One worker per role: none is wrong, hangs or is cut; a request may fail only by its deadline (a fault
  left nothing to serve it in time), as a clean ``timeout`` error, and at most a stated share do.
- Both: a calm phase first in which everything is served; after each fault the process is back in routing;
  after the last, every process is back within the run's limit and the next request is right; after
  shutdown no process the gateway ever started is left.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from preloaded import Preloaded

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"pd-prefill", "prfaas-prefill", "pd-decode", "link-emulator", "zygote"}
MAX_FAILED_SHARE_ONE_PER_ROLE = 0.25  # a killed only worker of a role is back in about 5 s of a 30 s deadline


@pytest.fixture(scope="module")
def runs(python: Preloaded) -> dict[int, dict]:
    found = {}
    for per_role, faults in ((2, ["--faults", "10", "--clustered"]), (1, ["--faults", "5"])):  # five: every kind
        cmd = ["benchmarks/bench_chaos.py", "--quick", "--json", "--per-role", str(per_role), *faults]
        done = python.run(cmd, cwd=ROOT, env=dict(os.environ), timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        *table, last = done.stdout.splitlines()
        print("\n".join(table))
        found[per_role] = json.loads(last)["runs"][0]
    return found


def check_common(run: dict) -> None:
    calm, chaos, faults = run["calm"], run["chaos"], run["faults"]
    assert calm["sent"] > 0 and calm["ok"] == calm["sent"], calm  # the calm phase: everything served
    assert chaos["sent"] >= 20 and chaos["wrong"] == chaos["hung"] == chaos["cut"] == 0, chaos
    assert {f["signal"] for f in faults} == {"SIGKILL", "SIGSTOP"}, faults
    killed = [f for f in faults if f["signal"] == "SIGKILL" and f["kind"] != "zygote"]
    assert all(f["recover_s"] is not None for f in killed), faults  # each left routing and came back
    assert run["after_ok"] and max(run["recovery_s"]) <= 30, run
    assert run["processes_left"] == [], run


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_workers_per_role_lose_nothing(runs: dict[int, dict]) -> None:
    run = runs[2]
    check_common(run)
    assert len(run["faults"]) >= 10, run["faults"]
    decode_hits = [f for f in run["faults"] if f["kind"] == "pd-decode"]
    together = [(a, b) for a in decode_hits for b in decode_hits if a["target"] < b["target"]]
    assert any(abs(a["at_s"] - b["at_s"]) < 3 for a, b in together), decode_hits  # both decode workers, at once
    chaos = run["chaos"]
    assert chaos["ok"] == chaos["sent"] and chaos["failed"] == 0, chaos
    assert chaos["migrated"] + chaos["fell_back"] > 0, chaos  # the faults did hit requests


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_one_worker_per_role_fails_only_past_a_deadline(runs: dict[int, dict]) -> None:
    run = runs[1]
    check_common(run)
    assert {f["kind"] for f in run["faults"]} == KINDS, run["faults"]
    chaos = run["chaos"]
    assert set(chaos["failed_by_cause"]) <= {"timeout"}, chaos  # nothing to serve it before its deadline
    assert chaos["ok"] + chaos["failed"] == chaos["sent"], chaos
    assert chaos["failed"] <= MAX_FAILED_SHARE_ONE_PER_ROLE * chaos["sent"], chaos
