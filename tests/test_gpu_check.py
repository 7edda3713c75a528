"""The device check's CPU dry run: every step end to end here, tiny sizes, one JSON line per step, and the figures
its steps are judged by present and exact (the CPU runs the torch kernels on both sides of each comparison); and
the ways a step must fail: no CUDA where CUDA is asked for, an error past the tolerance, a NaN."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from preloaded import Preloaded

ROOT = Path(__file__).resolve().parent.parent
PROBE = str(ROOT / "benchmarks" / "gpu_probe.py")


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_writes_each_as_it_ends(tmp_path: Path, python: Preloaded) -> None:
    out = tmp_path / "gpu_check.jsonl"
    argv = ["benchmarks/gpu_check.py", "--dry-run", "--python", str(python.interpreter()), "--out", str(out)]
    done = python.run(argv, cwd=ROOT, env=dict(os.environ), timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    steps = {r["step"]: r for r in records}
    assert list(steps)[:2] == ["env", "reference"], list(steps)
    assert {"kernels kimi-linear-tiny float32", "movement bfloat16", "scale qwen3.5-0.8b", "serve"} <= set(steps)
    assert all(r["ok"] and r["rc"] == 0 for r in records), records
    kernels = steps["kernels kimi-linear-tiny float32"]["result"]
    assert kernels["kernels"] == "torch" and kernels["triton_launches"] == 0  # the reference kernels on the CPU
    assert set(kernels["errors"].values()) == {0.0} and all(kernels["tokens_equal"].values()), kernels
    movement = steps["movement bfloat16"]["result"]
    assert movement["failures"] == [] and movement["repeat_prefill_bitwise"], movement
    served = steps["serve"]["result"]["requests"]
    assert served["long"]["route"] == "prfaas" and served["short"]["route"] != "prfaas", served
    assert served["long"]["equal_in_process"] and served["short"]["equal_in_process"], served
    scale = steps["scale qwen3.5-0.8b"]["result"]
    assert scale["kv_by_kind"]["full_attention"]["bytes_per_token"] > 0 and scale["decode"]["4"]["tok_s"] > 0
    for r in records:
        json.dumps(r, allow_nan=False)  # ValueError on a NaN or infinite figure


def test_asking_for_cuda_without_it_fails_rather_than_skips() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    done = subprocess.run(
        [sys.executable, PROBE, "env", "--device", "cuda:0"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode != 0 and "sees no CUDA device" in done.stderr, done.stderr[-2000:]


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory, python: Preloaded) -> Path:
    """The kernels step's reference for kimi-linear-tiny, made once by the probe's ``reference`` step."""
    where = tmp_path_factory.mktemp("reference")
    argv = [PROBE, "reference", "--model", "kimi-linear-tiny", "--tokens", "48", "--file", str(where)]
    done = python.run(argv, cwd=ROOT, env=dict(os.environ), timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return where


@pytest.mark.slow  # a probe process each, beside the reference's
@pytest.mark.parametrize("spoil", ["five percent", "nan"])
def test_an_error_past_the_tolerance_or_a_nan_fails_the_step_and_says_why(
    tmp_path: Path, reference_dir: Path, python: Preloaded, spoil: str
) -> None:
    """The kernels step against a reference whose logits are 5% off, or hold a NaN: it exits 1 naming the figure."""
    saved = torch.load(reference_dir / "kimi-linear-tiny.pt", weights_only=False)
    logits = (
        saved["logits"] * 1.05
        if spoil == "five percent"
        else saved["logits"].index_fill(0, torch.tensor([3]), math.nan)
    )
    torch.save({**saved, "logits": logits}, tmp_path / "kimi-linear-tiny.pt")
    argv = [PROBE, "kernels", "--model", "kimi-linear-tiny", "--tokens", "48", "--file", str(tmp_path)]
    argv += ["--device", "cpu"]
    done = python.run(argv, cwd=ROOT, env=dict(os.environ), timeout=180)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 1 and result["ok"] is False, result
    expected = "prefill_logits error" if spoil == "five percent" else "errors.prefill_logits is not finite"
    assert any(f.startswith(expected) for f in result["failures"]), result["failures"]
    assert "kernels failed: " in done.stderr
