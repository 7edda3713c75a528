"""The model to train: a preset's architecture, resized, with the byte vocabulary.

Every per-layer list in the config is repeated over the new depth, so the preset's layer schedule keeps its mix.
"""

from __future__ import annotations

from minifaas.model.loader import ModelSpec, load_config_dict, preset_names
from minifaas.model.tokenizer import ByteTokenizer


def architecture_dict(arch: str, layers: int | None, hidden: int | None, intermediate: int | None) -> dict:
    """The raw config.json of the model to train (no weights)."""
    if arch not in preset_names():
        raise ValueError(f"--arch {arch!r}: not a preset ({', '.join(preset_names())})")
    raw = dict(load_config_dict(ModelSpec.resolve(arch)))
    old_layers = raw["num_hidden_layers"]
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        for key, value in list(raw.items()):
            if isinstance(value, list) and len(value) == old_layers:
                raw[key] = [value[i % old_layers] for i in range(layers)]
        raw["num_hidden_layers"] = layers
    if "layer_types" in raw and "full_attention" not in raw["layer_types"]:
        raise ValueError(f"{raw['num_hidden_layers']} layers of {arch} have no full-attention layer")
    for key, value in (("hidden_size", hidden), ("intermediate_size", intermediate)):
        if value is not None:
            if value < 8 or value % 8:
                raise ValueError(f"{key} must be a positive multiple of 8, got {value}")
            raw[key] = value
    tok = ByteTokenizer
    raw.update(vocab_size=tok.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    raw.update(pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    raw.pop("torch_dtype", None)
    return raw
