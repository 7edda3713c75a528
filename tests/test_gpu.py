"""The GPU path, on a CUDA device; each check in its own process (benchmarks/gpu_probe.py).

Without CUDA every test here is collected and skipped with the reason. Tolerance of fla against the
torch reference (fp32): logits within 1% of their largest magnitude, the same greedy token, states
within 1% of each slot's largest magnitude. Exactness (bf16 and fp32): greedy prefill on the GPU,
staged to host memory, decoded unbatched and batched, equals transformers' own generate() on the same
GPU (``model.reference``) up to a first divergence at a near tie (within 1% of the top logit).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (no torch.cuda here)"),
]
MODELS = ["shakespeare-qwen3.5", "kimi-linear-tiny", "qwen3.5-tiny", "qwen3-tiny", "mimo-v2-tiny"]


def probe(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_probe.py"), *args],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", MODELS)
def test_fla_matches_the_torch_reference(model: str, tmp_path: Path) -> None:
    ref = str(tmp_path / "ref.pt")
    probe("reference", "--model", model, "--device", "cpu", "--tokens", "300", "--file", ref)
    got = probe("kernels", "--model", model, "--device", "cuda:0", "--tokens", "300", "--file", ref)
    assert got["kernels"] in ("fla", "none"), got  # none: a model without linear attention
    assert got["same_token"] and got["logit_rel_err"] <= got["tolerance"] and got["state_rel_err"] <= 0.01, got


@pytest.mark.parametrize("model", ["shakespeare-qwen3.5", "kimi-linear-tiny"])
def test_greedy_disaggregated_decode_equals_generate_on_the_gpu(model: str) -> None:
    got = probe("exactness", "--model", model, "--device", "cuda:0", "--tokens", "100")
    assert got["ok"] and got["failures"] == [], got
    for dtype in ("float32", "bfloat16"):
        assert got[dtype]["staged_on_host"] and got[dtype]["tolerance"] == 0.01, got
        assert all(got[dtype][path]["ok"] for path in ("unbatched", "batched r0", "batched r1", "batched r2")), got


def test_device_to_host_copies_pipeline_with_the_prefill() -> None:
    got = probe("pipelining", "--device", "cuda:0", "--tokens", "4096")
    assert got["tail_over_prefill"] < 0.5, got  # the transfer ends soon after the prefill, not a prefill later


def test_serve_end_to_end_on_cuda() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_serve.py", "--quick", "--json", "--device", "cuda:0"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    assert rows, out.stdout
