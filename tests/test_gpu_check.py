"""The device check's CPU dry run: every step end to end here, tiny sizes, one JSON file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from preloaded import Preloaded

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_writes_its_json(tmp_path: Path, python: Preloaded) -> None:
    out = tmp_path / "gpu_check.json"
    # each step a process of its own, forked from the pre-loaded interpreter through its stand-in for python
    argv = ["benchmarks/gpu_check.py", "--dry-run", "--python", str(python.interpreter()), "--out", str(out)]
    done = python.run(argv, cwd=ROOT, env=dict(os.environ), timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["dry_run"] and results["device"] == "cpu"
    steps = {k: v for k, v in results.items() if isinstance(v, dict)}
    assert {"install", "pytest -m gpu", "exactness", "pipelining", "decode batching", "served TTFT per route"} <= set(
        steps
    )
    assert all(v["rc"] == 0 for v in steps.values()), steps
    assert steps["kernels kimi-linear-tiny"]["result"]["kernels"] == "torch"  # the reference kernels on the CPU
    # the served step is bench_serve.py --quick --json, the smoke run tests/test_benchmarks_run.py leaves to this
    served = steps["served TTFT per route"]["result"]
    assert isinstance(served, dict) and served.get("rows"), served
    json.dumps(served, allow_nan=False)  # ValueError on a NaN or infinite figure: a run that measured nothing


def test_the_gpu_tests_are_collected_and_skipped_with_the_reason_on_the_cpu() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "tests/test_gpu.py", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    if "passed" in done.stdout:
        pytest.skip("a CUDA device is here: the gpu tests ran")
    assert done.returncode == 0 and "9 skipped" in done.stdout and "needs a CUDA device" in done.stdout, done.stdout
