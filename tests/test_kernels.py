"""flash-linear-attention must never be used on a CPU, even where it is installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

FLA_INSTALLED = importlib.util.find_spec("fla") is not None or "fla" in sys.modules


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_ci_environment_has_fla_installed() -> None:
    """CI installs the gpu extra on purpose, so the rest of the suite runs with fla importable."""
    if not os.environ.get("CI"):
        pytest.skip("only CI promises the gpu extra is installed")
    out = _run("import importlib.util; print(importlib.util.find_spec('fla') is not None)")
    assert out.stdout.strip() == "True", out.stderr


def test_cpu_runtime_blocks_fla_and_still_runs() -> None:
    code = (
        "import sys\n"
        "from minifaas.model.runtime import ModelRuntime\n"
        "rt = ModelRuntime.load('kimi-linear-tiny')\n"
        "assert sys.modules['fla'] is None\n"
        "print(rt.generate(list(range(20)))[:4])\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.skipif(not FLA_INSTALLED, reason="flash-linear-attention is not installed here")
def test_without_the_block_an_installed_fla_breaks_cpu_forward() -> None:
    """The failure the block prevents: transformers picks fla's Triton kernels, which need a GPU."""
    code = (
        "import torch, json\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "from minifaas.model.loader import MODELS_DIR\n"
        "raw = json.loads((MODELS_DIR / 'presets' / 'kimi-linear-tiny.json').read_text())\n"
        "cfg = AutoConfig.for_model(raw.pop('model_type'), **{k: v for k, v in raw.items() if k != 'architectures'})\n"
        "m = AutoModelForCausalLM.from_config(cfg).eval()\n"
        "m(torch.arange(70)[None])\n"
    )
    out = _run(code)
    assert out.returncode != 0 and "active drivers" in out.stderr, out.stderr[-2000:]


def test_cuda_kernel_choice_refuses_a_process_that_blocked_fla() -> None:
    out = _run(
        "from minifaas.model.kernels import select_kernels\n"
        "assert select_kernels('cpu') == 'torch'\n"
        "try:\n    select_kernels('cuda:0')\nexcept RuntimeError as e:\n    print('refused', e)\n"
    )
    assert "refused" in out.stdout, out.stderr
