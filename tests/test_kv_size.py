"""kv-size from a config alone must equal the bytes the runtime really holds, and real configs the known figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minifaas.commands.main import main
from minifaas.model.kv_size import kv_profile
from minifaas.model.loader import MODELS_DIR, ModelSpec, load_config_dict, preset_names
from minifaas.model.runtime import ModelRuntime

CONFIGS = MODELS_DIR / "configs"


@pytest.mark.slow  # loads and prefills every preset
@pytest.mark.parametrize("preset", preset_names())
def test_config_arithmetic_equals_measured_state_bytes(preset: str) -> None:
    rt = ModelRuntime.load(preset)
    profile = kv_profile(load_config_dict(ModelSpec.resolve(preset)))
    for n in (1, 40, 200):
        state = rt.prefill([7] * n).state
        assert profile.bytes_at(n) == state.nbytes, f"{preset} at {n} tokens"


@pytest.mark.parametrize(
    ("config", "per_token", "fixed"),
    [
        # bytes/token over all growing layers (bf16) and fixed state per request (fp32 recurrent + bf16 conv, HF layout)
        ("Qwen__Qwen3.5-397B-A17B.aiconfigurator.json", 30720, 45 * (64 * 128 * 128 * 4 + 12288 * 4 * 2)),
        ("Qwen__Qwen3-235B-A22B.json", 192512, 0),
        ("derivative__nvidia__MiniMax-M2.5-NVFP4.json", 253952, 0),
        ("Qwen__Qwen3-Next-80B-A3B-Instruct.json", 24576, 36 * (32 * 128 * 128 * 4 + 8192 * 4 * 2)),
    ],
)
def test_real_configs_match_the_reference_figures(config: str, per_token: int, fixed: int) -> None:
    p = kv_profile(json.loads((CONFIGS / config).read_text()))
    assert sum(c.bytes_per_token for c in p.layers if c.window is None) == per_token
    assert sum(c.fixed_bytes for c in p.layers) == fixed


def test_mimo_sliding_window_is_capped() -> None:
    p = kv_profile(json.loads((CONFIGS / "XiaomiMiMo__MiMo-V2-Flash.aiconfigurator.json").read_text()))
    kinds = p.by_kind()
    assert kinds["full_attention"][:2] == (9, 23040) and kinds["sliding_window"][0] == 39
    assert p.bytes_at(10**6) - p.bytes_at(10**6 - 1) == 23040  # past the window only full layers grow
    assert p.bytes_at(128) - 128 * 23040 == 39 * 128 * 5120  # 24.38 MiB of sliding state at the cap


def test_cli_json_compares_hybrid_with_dense(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kv-size", "--model", "kimi-linear-tiny", "--model", "qwen3-tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kimi-linear-tiny"]["ratio_vs_baseline"]["32768"] > 10
    assert out["qwen3-tiny"]["fixed_bytes"] == 0


def test_cli_accepts_a_bare_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {
        "model_type": "qwen3",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_size": 512,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["kv-size", "--model", str(tmp_path / "config.json"), "--json", "--lengths", "1000"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["bytes_at"]["1000"] == 4 * 2 * 2 * 64 * 2 * 1000


def test_kimi_linear_reconstructed_config_matches_the_reference_figures() -> None:
    cfg = json.loads((CONFIGS / "moonshotai__Kimi-Linear-48B-A3B-Instruct.reconstructed.json").read_text())
    p = kv_profile(cfg)
    kinds = p.by_kind()
    assert kinds["mla"][:2] == (7, 8064)  # (512 + 64) x 2 bytes per MLA layer
    assert kinds["linear"][0] == 20 and kinds["linear"][2] == 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 4 * 2)


def test_the_default_model_is_named_by_its_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kv-size", "--json", "--lengths", "1000"]) == 0
    assert list(json.loads(capsys.readouterr().out)) == ["shakespeare-qwen3.5"]  # not its file's name, "config"
