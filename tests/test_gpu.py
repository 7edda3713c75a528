"""The GPU path, on a CUDA device; each step in its own process (benchmarks/gpu_probe.py).

Without CUDA every test here is collected and skipped with the reason. fla against the CPU torch reference in
float32 with Triton's dots in IEEE precision: logits, every state and decoded logits within 1e-4 of the largest
magnitude, the kernel label ``fla`` and Triton kernels counted. Data movement in bfloat16 is bitwise, and a served
request equals an in-process run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PROBE = str(ROOT / "benchmarks" / "gpu_probe.py")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (no torch.cuda here)"),
]
FAMILIES = ["kimi-linear-tiny", "qwen3.5-tiny", "models/families/qwen3_next.json"]
EXACT = {"TRITON_F32_DEFAULT": "ieee", "MINIFAAS_PROBE_ONE_CONFIG": "1"}


def probe(*args: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, PROBE, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", FAMILIES)
def test_fla_matches_the_cpu_torch_reference(model: str, tmp_path: Path) -> None:
    common = ["--model", model, "--tokens", "256", "--file", str(tmp_path)]
    probe("reference", *common)
    got = probe("kernels", *common, "--device", "cuda:0", env=EXACT)
    assert got["kernels"] == "fla" and got["triton_launches"] > 0, got
    assert max(got["errors"].values()) <= 1e-4 and all(got["tokens_equal"].values()), got


def test_data_movement_is_bitwise() -> None:
    got = probe("movement", "--device", "cuda:0", "--tokens", "300", env=EXACT)
    assert got["ok"] and got["pinned"], got


def test_a_served_request_equals_an_in_process_run() -> None:
    got = probe("serve", "--device", "cuda:0", "--model", "shakespeare-qwen3.5")
    assert all(r["equal_in_process"] for r in got["requests"].values()), got
