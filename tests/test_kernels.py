"""flash-linear-attention must never be used on a CPU, even where it is installed."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
GPU_EXTRA = [Requirement(r) for r in tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["gpu"]]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@functools.cache
def installed_gpu_extra() -> dict[str, str]:
    """The gpu extra's packages and versions as a fresh interpreter finds them (fla found, never imported: a
    process that loaded a CPU model has it blocked); empty where fla is not installed."""
    out = _run(
        "import importlib.util, importlib.metadata as m, json\n"
        f"names = {[r.name for r in GPU_EXTRA]!r}\n"
        "found = importlib.util.find_spec('fla') is not None\n"
        "print(json.dumps({n: m.version(n) for n in names} if found else {}))\n"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_where_fla_is_installed_it_is_the_version_the_gpu_extra_pins() -> None:
    """Wherever the gpu extra is installed the fla-specific tests below run, against the versions it pins."""
    versions = installed_gpu_extra()
    if not versions:
        pytest.skip("flash-linear-attention is not installed here (pip install -e '.[gpu]')")
    for requirement in GPU_EXTRA:
        assert requirement.specifier.contains(versions[requirement.name]), (requirement, versions)


def test_importing_the_model_and_worker_code_imports_neither_fla_nor_triton() -> None:
    """Only the model's own code may pull fla in, after ``select_kernels`` has decided (and on a CPU, kept it
    out); triton then comes only with torch's compiler, never with TRITON_INTERPRET from here."""
    out = _run(
        "import os, sys\n"
        "import minifaas.model.runtime, minifaas.worker.worker_process, minifaas.commands.main\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'fla', 'triton'}), 'TRITON_INTERPRET' in os.environ)\n"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "False"], out.stdout


@pytest.mark.slow  # a child process per case
def test_cpu_runtime_blocks_fla_and_still_runs() -> None:
    code = (
        "import sys\n"
        "from minifaas.model.interleaved_decoder import generate\n"
        "from minifaas.model.runtime import ModelRuntime\n"
        "rt = ModelRuntime.load('kimi-linear-tiny')\n"
        "assert sys.modules['fla'] is None\n"
        "assert sys.modules['triton'] is None  # torch's compiler, imported by transformers, finds none\n"
        "print(generate(rt, list(range(20)))[:4])\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow  # a child process per case
def test_without_the_block_an_installed_fla_never_runs_on_the_cpu() -> None:
    """Without the block transformers binds fla's Triton kernels, which need a GPU: a CPU forward either
    fails in them, or transformers sends its CPU inputs to the torch reference (it says so), where its
    wrapper routes by the inputs' device. The block keeps fla out either way, so the report says "torch"."""
    if not installed_gpu_extra():
        pytest.skip("flash-linear-attention is not installed here")
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
    if out.returncode == 0:
        assert "`chunk_kda` is falling back to its reference PyTorch implementation" in out.stderr, out.stderr[-2000:]
    else:
        assert "active drivers" in out.stderr, out.stderr[-2000:]


def test_cuda_kernel_choice_refuses_a_process_that_blocked_fla() -> None:
    out = _run(
        "from minifaas.model.kernels import select_kernels\n"
        "assert select_kernels('cpu') == 'torch'\n"
        "try:\n    select_kernels('cuda:0')\nexcept RuntimeError as e:\n    print('refused', e)\n"
    )
    assert "refused" in out.stdout, out.stderr


def test_the_kernel_report_reads_what_a_cpu_model_is_bound_to() -> None:
    """On the CPU fla is blocked, so transformers bound every fla function to its torch reference:
    the report must say so (this is the check a CUDA worker runs before it refuses to start)."""
    code = (
        "import json\n"
        "from minifaas.model.runtime import ModelRuntime\n"
        "out = {}\n"
        "for name in ('kimi-linear-tiny', 'shakespeare-qwen3.5', 'qwen3-tiny'):\n"
        "    out[name] = ModelRuntime.load(name).kernels.to_json()\n"
        "print(json.dumps(out))\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr[-2000:]
    reports = json.loads(out.stdout.strip().splitlines()[-1])
    assert reports["qwen3-tiny"] == {"kernels": "none", "bindings": {}, "ran": {}}  # dense: nothing to bind
    kimi, qwen = reports["kimi-linear-tiny"], reports["shakespeare-qwen3.5"]
    assert kimi["kernels"] == qwen["kernels"] == "torch"
    assert {"chunk_kda", "fused_recurrent_kda"} <= set(kimi["bindings"])
    assert {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"} <= set(qwen["bindings"])
    assert all(module.startswith("transformers.models.") for module in qwen["bindings"].values())


def test_a_cuda_worker_refuses_the_reference_kernels_unless_allowed() -> None:
    from minifaas.model.kernels import KernelBinding, KernelReport, require_fast

    slow = KernelReport((KernelBinding("chunk_kda", "fla", "transformers.models.kimi_linear.modeling_kimi_linear"),))
    fast = KernelReport((KernelBinding("chunk_kda", "fla", "fla.ops.kda.chunk"),))
    conv = KernelBinding("causal_conv1d_fn", "causal_conv1d", "transformers.models.kimi_linear.modeling_kimi_linear")
    assert (slow.label, fast.label, KernelReport((conv,)).label) == ("torch", "fla", "none")
    with pytest.raises(RuntimeError, match="--allow-slow-kernels"):
        require_fast(slow, "cuda:0", allow_slow=False)
    require_fast(slow, "cuda:0", allow_slow=True)
    require_fast(slow, "cpu", allow_slow=False)  # the CPU has no other kernels
    require_fast(KernelReport((*fast.bindings, conv)), "cuda:0", allow_slow=False)  # conv1d's torch path is fine
