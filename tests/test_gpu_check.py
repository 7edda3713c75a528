"""The device check's CPU dry run: every step end to end here, tiny sizes, one JSON file, and the figures
its steps are judged by present and within their tolerance (exact, on the CPU in float32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu_check  # benchmarks/, on the path through conftest.py
import pytest
import torch
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
    kernels = steps["kernels kimi-linear-tiny"]["result"]
    assert kernels["kernels"] == "torch"  # the reference kernels on the CPU
    assert kernels["ok"] and kernels["same_token"], kernels
    assert kernels["logit_rel_err"] <= kernels["tolerance"] and kernels["state_rel_err"] <= kernels["tolerance"]
    exact = steps["exactness"]["result"]
    assert exact["ok"] and exact["failures"] == [], exact
    paths = ["unbatched", "batched r0", "batched r1", "batched r2"]
    assert exact["float32"]["tolerance"] == 0.0 and exact["float32"]["staged_on_host"]
    assert all(exact["float32"][path] == {"equal": True, "ok": True} for path in paths), exact["float32"]
    assert all(exact["bfloat16"][path]["ok"] for path in paths), exact["bfloat16"]
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


@pytest.mark.slow  # two probe processes
def test_a_kernel_error_beyond_the_tolerance_fails_the_step_and_says_why(tmp_path: Path) -> None:
    """The kernels probe against a reference whose logits are 5% off: it exits 1, and the device check
    counts the step failed with the probe's own reason."""
    ref = tmp_path / "ref.pt"
    common = ["--model", "kimi-linear-tiny", "--tokens", "48", "--device", "cpu", "--file", str(ref)]
    results: dict = {}
    assert gpu_check.step("reference", [sys.executable, gpu_check.PROBE, "reference", *common], 120, results)["rc"] == 0
    saved = torch.load(ref)
    torch.save({**saved, "logits": saved["logits"] * 1.05}, ref)
    record = gpu_check.step("kernels", [sys.executable, gpu_check.PROBE, "kernels", *common], 120, results)
    assert record["rc"] == 1 and record["result"]["ok"] is False and not gpu_check.passed(record), record
    assert gpu_check.why(record).startswith("logit error") and "over the tolerance 0.01" in gpu_check.why(record)
    assert "kernels kimi-linear-tiny failed: logit error" in record["tail"]
