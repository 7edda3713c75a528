"""Find a model by name, path or hub id and build it: presets, checkpoints, bare configs.

A *preset* is a transformers config (models/presets/<name>.json) of a real architecture, initialised from a
seed in float32, so one name and seed give identical weights in every process on one torch build. A *checkpoint*
is a directory with config.json, weights and a tokenizer, loaded with ``from_pretrained``: shipped, local, or a
hub id. A bare config.json is enough for ``kv-size`` and the planner.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from minifaas.model.hub import hub_cache_dir, hub_snapshot, looks_like_hub_id
from minifaas.model.kernels import select_kernels
from minifaas.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

DEFAULT_MODEL = "shakespeare-qwen3.5"
MODELS_DIR = Path(os.environ.get("MINIFAAS_MODELS_DIR", Path(__file__).resolve().parents[2] / "models"))
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)


def preset_names() -> list[str]:
    return sorted(p.stem for p in (MODELS_DIR / "presets").glob("*.json"))


def checkpoint_names() -> list[str]:
    """The trained checkpoints shipped in models/checkpoints/, by directory name."""
    return sorted(p.parent.name for p in (MODELS_DIR / "checkpoints").glob("*/config.json"))


def dtype_name(name: str, device: str) -> str:
    """``--dtype``: auto is bfloat16 on CUDA and float32 on the CPU (where bfloat16 matmuls are slow)."""
    if name == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    return name


def resolve_dtype(name: str, device: str) -> torch.dtype:
    return DTYPES[dtype_name(name, device)]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where a model comes from. ``kind`` is "preset", "checkpoint" or "config"."""

    name: str
    kind: str
    path: Path  # its config.json
    seed: int = 0

    @classmethod
    def resolve(cls, name_or_path: str, seed: int = 0) -> ModelSpec:
        """In order: a preset, a shipped checkpoint, a local directory or config.json, a hub id."""
        preset = MODELS_DIR / "presets" / f"{name_or_path}.json"
        if preset.is_file():
            return cls(name_or_path, "preset", preset, seed)
        shipped = MODELS_DIR / "checkpoints" / name_or_path
        if name_or_path in checkpoint_names():
            return cls(name_or_path, "checkpoint", shipped / "config.json", seed)
        path = Path(name_or_path).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            return cls(path.name, _dir_kind(path), path / "config.json", seed)
        if path.is_file() and path.suffix == ".json":
            return cls(path.stem, "config", path, seed)
        if looks_like_hub_id(name_or_path) and not path.exists():
            try:
                snapshot = hub_snapshot(name_or_path)
            except FileNotFoundError as e:
                raise FileNotFoundError(
                    f"no model {name_or_path!r}: not a preset, a shipped checkpoint or a local directory; "
                    f"as a hub id: {e}"
                ) from e
            if not (snapshot / "config.json").is_file():
                raise FileNotFoundError(f"{name_or_path}: its hub snapshot {snapshot} has no config.json")
            return cls(name_or_path, _dir_kind(snapshot), snapshot / "config.json", seed)
        raise FileNotFoundError(
            f"no model {name_or_path!r}: not a preset ({', '.join(preset_names())}), "
            f"a shipped checkpoint ({', '.join(checkpoint_names()) or 'none'}), "
            + (f"{path}: no config.json in that directory, " if path.is_dir() else "a local directory, ")
            + f"or a hub id org/name (cache {hub_cache_dir()})"
        )

    @property
    def directory(self) -> Path:
        return self.path.parent


def _dir_kind(path: Path) -> str:
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    return "checkpoint" if has_weights else "config"


def load_config_dict(spec: ModelSpec) -> dict:
    """The model's config.json as a dict (a multimodal config's ``text_config``); ValueError naming the file if it
    is not a JSON object."""
    try:
        raw = json.loads(spec.path.read_text())
    except ValueError as e:
        raise ValueError(f"{spec.path}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{spec.path}: not a config (a JSON object), got {type(raw).__name__}")
    return raw.get("text_config", raw) if "layer_types" not in raw and "text_config" in raw else raw


_NO_WEIGHTS = "{}: a bare config.json has no weights; use a preset or a checkpoint directory"


def needs_remote_code(spec: ModelSpec, trust_remote_code: bool) -> bool:
    """Whether the checkpoint's own code (auto_map) builds it; refused in one line unless trusted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = load_config_dict(spec)
    if spec.kind == "preset" or "auto_map" not in raw or raw.get("model_type") in CONFIG_MAPPING:
        return False
    if not trust_remote_code:
        raise ValueError(
            f"{spec.name}: model type {raw.get('model_type')!r} is the checkpoint's own code (auto_map); "
            "pass --trust-remote-code to let it run"
        )
    return True


def checked_spec(name_or_path: str, trust_remote_code: bool = False) -> ModelSpec:
    """What ``--model`` names, refused before anything loads if it cannot be (FileNotFoundError, ValueError):
    a bare config, with no weights to load, is refused too."""
    spec = ModelSpec.resolve(name_or_path)
    if spec.kind == "config":
        raise ValueError(_NO_WEIGHTS.format(spec.path))
    needs_remote_code(spec, trust_remote_code)
    return spec


def load_config(spec: ModelSpec, trust_remote_code: bool = False):  # -> transformers.PretrainedConfig
    if needs_remote_code(spec, trust_remote_code):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(
            str(spec.directory), trust_remote_code=trust_remote_code, local_files_only=True
        )
    return config_from_dict(load_config_dict(spec))


def config_from_dict(raw: dict):  # -> transformers.PretrainedConfig
    from transformers import AutoConfig

    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "torch_dtype", "dtype")}
    return AutoConfig.for_model(raw["model_type"], **kwargs)


def load_model(
    spec: ModelSpec, device: str = "cpu", dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> torch.nn.Module:
    """Build the model on ``device``, eval mode, with the kernels that device supports."""
    select_kernels(device)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if spec.kind == "checkpoint":
        needs_remote_code(spec, trust_remote_code)
        hf_logging.disable_progress_bar()  # a bar per worker start says nothing the ready line does not
        model = AutoModelForCausalLM.from_pretrained(
            str(spec.directory), dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code
        )
    elif spec.kind == "preset":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model = AutoModelForCausalLM.from_config(load_config(spec), dtype=torch.float32)
        model = model.to(dtype)
    else:
        raise ValueError(_NO_WEIGHTS.format(spec.path))
    return model.to(device).eval()


def load_tokenizer(spec: ModelSpec, trust_remote_code: bool = False) -> Tokenizer:
    """The byte tokenizer for a preset; a checkpoint's own (AutoTokenizer) otherwise."""
    if spec.kind == "preset":
        return ByteTokenizer()
    needs_remote_code(spec, trust_remote_code)  # before AutoTokenizer, which would only warn
    return HFTokenizer(spec.directory, trust_remote_code)
