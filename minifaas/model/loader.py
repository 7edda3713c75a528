"""Find a model by name or path and build it: presets, checkpoint directories, bare configs.

A *preset* is a transformers config (models/presets/<name>.json) of a real
architecture, initialised from a seed: ``torch.manual_seed(seed)`` on the CPU,
then the model class's own init, in float32. The same name and seed give
bit-identical weights in every process on the same torch build (tests check it
across processes with ``weights_digest``). A *checkpoint* is a local directory
with config.json and weights, loaded with ``from_pretrained``; a bare
config.json (no weights) is enough for ``kv-size`` and the planner.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from minifaas.model.kernels import select_kernels

DEFAULT_MODEL = "kimi-linear-tiny"
MODELS_DIR = Path(os.environ.get("MINIFAAS_MODELS_DIR", Path(__file__).resolve().parents[2] / "models"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in (MODELS_DIR / "presets").glob("*.json"))


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where a model comes from. ``kind`` is "preset", "checkpoint" or "config"."""

    name: str
    kind: str
    path: Path
    seed: int = 0

    @classmethod
    def resolve(cls, name_or_path: str, seed: int = 0) -> ModelSpec:
        preset = MODELS_DIR / "presets" / f"{name_or_path}.json"
        if preset.is_file():
            return cls(name_or_path, "preset", preset, seed)
        path = Path(name_or_path).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
            return cls(path.name, "checkpoint" if has_weights else "config", path / "config.json", seed)
        if path.is_file() and path.suffix == ".json":
            return cls(path.stem, "config", path, seed)
        raise FileNotFoundError(
            f"no model {name_or_path!r}: not a preset ({', '.join(preset_names())}), "
            "a checkpoint directory, or a config.json file"
        )


def load_config_dict(spec: ModelSpec) -> dict:
    raw = json.loads(spec.path.read_text())
    return raw.get("text_config", raw) if "layer_types" not in raw and "text_config" in raw else raw


def load_config(spec: ModelSpec):  # -> transformers.PretrainedConfig
    from transformers import AutoConfig

    raw = load_config_dict(spec)
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "torch_dtype", "dtype")}
    return AutoConfig.for_model(raw["model_type"], **kwargs)


def load_model(spec: ModelSpec, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Build the model on ``device``, eval mode, with the kernels that device supports."""
    select_kernels(device)
    from transformers import AutoModelForCausalLM

    if spec.kind == "checkpoint":
        model = AutoModelForCausalLM.from_pretrained(str(spec.path.parent), dtype=dtype, local_files_only=True)
    elif spec.kind == "preset":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model = AutoModelForCausalLM.from_config(load_config(spec), dtype=torch.float32)
        model = model.to(dtype)
    else:
        raise ValueError(f"{spec.name}: a bare config.json has no weights; use a preset or a checkpoint directory")
    return model.to(device).eval()


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer, in name order: equal digests mean equal weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
