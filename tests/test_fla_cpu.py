"""The GPU path of the hybrid families, flash-linear-attention's Triton kernels, run on the CPU under Triton's
interpreter and held against the torch path and transformers' own forwards.

Each family runs in a child process of its own (tests/fla_cpu_child.py), the only place ``TRITON_INTERPRET``
and the interpreter's shims (tests/fla_interpreter.py) exist: every other process keeps fla out. The children
run at once, one core each. Per family, on the fla path and on the torch path: a prefill with a cache, a
prefill continued from its state and greedy decode steps, whose logits and every layer's state must agree with
transformers' own forwards; the fla kernels must have run (launches counted in the interpreter) on the fla path
and none on the torch path; the kernel report must name what each layer kind ran; and one request served across
the real transport, prefilled on one path and decoded on the other, must give transformers' ``generate`` tokens.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("fla_cpu_child.py")
# the tiny families whose linear layers transformers hands to fla: gated delta rule (Qwen3.5, Qwen3-Next), KDA (Kimi)
FAMILIES = {"qwen3_5_text": "gated_delta_rule", "qwen3_next": "gated_delta_rule", "kimi_linear": "kda"}
PROMPT_TOKENS = 72  # past one 64-token chunk of the kernels; then half as many more from its state, then decode steps
TOLERANCE = 1e-5  # float32: the interpreted kernels round apart from torch's by ~1e-7 here
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def children() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every family's child, started together, as it finished."""
    for package in ("triton", "flash-linear-attention"):  # installed, asked without importing (a CPU process
        try:  # of this suite may have blocked fla's import already, as minifaas.model.kernels does)
            importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{package} is not installed: the fla path needs the gpu extra (pip install -e '.[gpu]')")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    running = {
        family: subprocess.Popen(
            [sys.executable, str(CHILD), family, str(PROMPT_TOKENS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for family in FAMILIES
    }
    done = {}
    try:
        for family, child in running.items():
            out, err = child.communicate(timeout=540)
            done[family] = subprocess.CompletedProcess(child.args, child.returncode, out, err)
    finally:
        for child in running.values():
            if child.poll() is None:  # left running by a child that timed out
                child.kill()
                child.wait()
    return done


@pytest.fixture(params=list(FAMILIES))
def figures(request: pytest.FixtureRequest, children: dict[str, subprocess.CompletedProcess[str]]) -> dict:
    child = children[request.param]
    assert child.returncode == 0, f"{request.param}: the child failed:\n{child.stderr[-3000:]}"
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_both_paths_agree_with_transformers_in_logits_and_every_state(figures: dict) -> None:
    for path in ("torch", "fla"):
        run = figures[path]
        assert run["logit_err"] <= TOLERANCE and run["state_err"] <= TOLERANCE, (path, run)
        assert run["tokens"] == figures["reference_tokens"], path
    assert max(figures["fla_vs_torch"].values()) <= TOLERANCE, figures["fla_vs_torch"]


def test_fla_kernels_ran_on_the_fla_path_and_none_on_the_torch_path(figures: dict) -> None:
    op = FAMILIES[figures["family"]]
    fla, torch = figures["fla"]["launches"], figures["torch"]["launches"]
    assert torch == {}, torch
    assert any(name.startswith("chunk_") for name in fla), fla  # the prefills
    assert fla.get(f"fused_recurrent_{op}_fwd_kernel", 0) >= 3, fla  # a launch per layer and decode step at least


def test_the_kernel_report_names_what_each_layer_kind_ran(figures: dict) -> None:
    """Both paths are bound to fla; only what ran tells them apart, the convolution's torch fallback included."""
    op = FAMILIES[figures["family"]]
    fast = {f"chunk_{op}", f"fused_recurrent_{op}"}
    for path in ("torch", "fla"):
        report = figures[path]["report"]
        assert all(report["bindings"][name].startswith("fla.") for name in fast), report["bindings"]
        assert report["kernels"] == path, report
        ran = report["ran"]["linear_attention"]
        assert ran.keys() == fast | {"causal_conv1d_fn", "causal_conv1d_update"}, ran
        assert all(ran[name].startswith("fla." if path == "fla" else "transformers.") for name in fast), ran
        assert ran["causal_conv1d_fn"].startswith("transformers.") and ran["causal_conv1d_update"].startswith(
            "transformers."
        ), ran  # causal_conv1d is not installed: the short convolution runs torch on both paths


def test_one_request_prefilled_on_one_path_and_decoded_on_the_other_across_the_wire(figures: dict) -> None:
    for route, served in figures["served"].items():
        prefill_path, decode_path = route.split("->")
        assert served["tokens"] == figures["generate"], route
        launches = served["launches"]
        assert (launches["prefill"] > 0) == (prefill_path == "fla"), (route, launches)
        assert (launches["decode"] > 0) == (decode_path == "fla"), (route, launches)
