"""A model's ``KVProfile`` from a config.json alone (no transformers, no weights), whichever family wrote it.

Each layer's state grows with length (full attention, MLA), is bounded (a sliding window), is fixed (linear
attention, Mamba, a short convolution, RG-LRU) or is nothing (MLP and MoE layers); Falcon-H1's ``attention+mamba``
is both. Sizes count what transformers' caches hold, in ``dtype`` (the model's as it runs) or else the config's; a
recurrent state is float32 unless the config names a dtype.
"""

from __future__ import annotations

from minifaas.model.layer_state import KVProfile, LayerCost

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8": 1}


def kv_profile(cfg: dict, name: str = "", dtype: str | None = None) -> KVProfile:
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    n = int(cfg["num_hidden_layers"])
    kv_b = DTYPE_BYTES.get(str(dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"), 2)
    state_b = DTYPE_BYTES.get(str(cfg.get("mamba_ssm_dtype", "float32")), 4)
    return KVProfile(
        name or cfg.get("model_type", "model"), tuple(_layer_cost(cfg, k, kv_b, state_b) for k in layer_kinds(cfg, n))
    )


# a layer type name, as configs spell it, -> the kind of state it keeps
_TYPE_NAMES = {
    "full_attention": "full", "attention": "full", "sliding_attention": "sliding", "linear_attention": "linear",
    "mamba": "linear", "conv": "conv", "hybrid": "parallel", "moe": "none", "mlp": "none",
}  # fmt: skip
_PATTERN = {"M": "linear", "*": "full", "E": "none", "-": "none"}  # Nemotron-H's hybrid_override_pattern
_MAMBA1 = ("jamba", "zamba")  # one recurrent row per inner channel; the others are Mamba2 (heads x head_dim)


def layer_kinds(cfg: dict, n: int) -> list[str]:
    """One of full / sliding / linear / conv / parallel / rglru / none per layer, from whichever key the config
    uses; each rule follows what transformers builds from that key."""
    for key in ("layer_types", "layers_block_type"):
        if isinstance(cfg.get(key), list):
            return [_TYPE_NAMES.get(t, "full") for t in cfg[key]]
    lin = cfg.get("linear_attn_config") or {}
    if "full_attn_layers" in lin:  # Kimi Linear, 1-based
        full = set(lin["full_attn_layers"])
        return ["full" if i + 1 in full else "linear" for i in range(n)]
    if isinstance(cfg.get("hybrid_layer_pattern"), list):  # MiMo: 1 = sliding
        return ["sliding" if p else "full" for p in cfg["hybrid_layer_pattern"]]
    if isinstance(cfg.get("attn_type_list"), list):  # MiniMax: 1 = softmax attention, 0 = lightning
        return ["full" if t else "linear" for t in cfg["attn_type_list"]]
    if isinstance(cfg.get("hybrid_override_pattern"), str):
        return [_PATTERN[c] for c in cfg["hybrid_override_pattern"]]
    if isinstance(cfg.get("block_types"), list):  # RecurrentGemma, cycled over the layers
        return [("rglru" if t == "recurrent" else "sliding") for t in (cfg["block_types"] * n)[:n]]
    if cfg.get("full_attention_interval"):
        k = int(cfg["full_attention_interval"])
        return ["full" if (i + 1) % k == 0 else "linear" for i in range(n)]
    if cfg.get("layer_group_size"):  # Ring / Bailing linear
        k = int(cfg["layer_group_size"])
        return ["full" if (i + 1) % k == 0 or i >= n // k * k else "linear" for i in range(n)]
    if "full_attn_idxs" in cfg:  # LFM2
        return ["full" if i in set(cfg["full_attn_idxs"]) else "conv" for i in range(n)]
    if cfg.get("model_type") == "falcon_h1":
        return ["parallel"] * n
    if isinstance(cfg.get("attn_layer_indices"), list):  # Bamba
        return ["full" if i in set(cfg["attn_layer_indices"]) else "linear" for i in range(n)]
    if cfg.get("attn_layer_period"):
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset", 0))
        if cfg.get("model_type") == "zamba":  # three fixed layers, then its shared attention every period
            rest = ["parallel" if i % period == offset else "linear" for i in range(n - 3)]
            return ["linear", "linear", "parallel", *rest]
        return ["full" if i % period == offset else "linear" for i in range(n)]  # Jamba
    if cfg.get("model_type") == "gated_deltanet":
        return ["linear"] * n
    return ["full"] * n


def _layer_cost(cfg: dict, kind: str, kv_b: int, state_b: int) -> LayerCost:
    heads = int(cfg.get("num_attention_heads", 1))
    hidden = int(cfg.get("hidden_size", 0))
    wide = 2 if cfg.get("model_type") in ("zamba", "zamba2") else 1  # Zamba's attention runs on [x, x0]
    head_dim = int(cfg.get("attention_head_dim") or cfg.get("head_dim") or wide * hidden // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if kind == "none":
        return LayerCost("none", 0, 0)
    if kind == "full":
        if cfg.get("kv_lora_rank"):
            return LayerCost("mla", (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])) * kv_b, 0)
        v_dim = int(cfg.get("v_head_dim") or head_dim)
        return LayerCost("full_attention", kv_heads * (head_dim + v_dim) * kv_b, 0)
    if kind == "sliding":
        doubled = 2 * kv_heads if cfg.get("model_type") == "mimo_v2_flash" else kv_heads  # transformers' MiMo
        swa_heads = int(cfg.get("swa_num_key_value_heads") or doubled)
        k_dim = int(cfg.get("swa_head_dim") or head_dim)
        v_dim = int(cfg.get("swa_v_head_dim") or cfg.get("v_head_dim") or head_dim)
        span = cfg.get("sliding_window") or cfg["attention_window_size"]  # RecurrentGemma's name for it
        window = int(cfg.get("sliding_window_size") or int(span) - 1)
        return LayerCost("sliding_window", swa_heads * (k_dim + v_dim) * kv_b, 0, window)
    if kind == "linear":
        if _is_mamba(cfg):
            return LayerCost("mamba", 0, _mamba_state_bytes(cfg, kv_b, state_b))
        return LayerCost("linear", 0, _linear_state_bytes(cfg, kv_b, state_b))
    if kind == "conv":
        kernel = int(cfg.get("conv_L_cache") or (7 if cfg.get("model_type") == "lfm3" else 3))
        return LayerCost("conv", 0, int(cfg.get("conv_dim") or hidden) * kernel * kv_b)
    if kind == "parallel":  # attention and a Mamba mixer side by side in one layer (Falcon-H1, Zamba's hybrids)
        return LayerCost("attention+mamba", kv_heads * 2 * head_dim * kv_b, _mamba_state_bytes(cfg, kv_b, state_b))
    if kind == "rglru":  # RecurrentGemma: the RG-LRU state (float32) and its conv tail
        width = int(cfg.get("lru_width") or hidden)
        return LayerCost("rglru", 0, width * 4 + width * (int(cfg.get("conv1d_width", 4)) - 1) * kv_b)
    raise ValueError(f"unknown layer kind {kind!r}")


def _is_mamba(cfg: dict) -> bool:
    return any(k in cfg for k in ("mamba_d_state", "ssm_state_size"))


def _mamba_state_bytes(cfg: dict, kv_b: int, state_b: int) -> int:
    """An SSM state of inner x d_state and a conv tail over the inner channels (Mamba2: and over B and C)."""
    hidden = int(cfg["hidden_size"])
    d_state = int(cfg.get("mamba_d_state") or cfg["ssm_state_size"])
    d_conv = int(cfg.get("mamba_d_conv") or cfg.get("conv_kernel") or 4)
    expand = float(cfg.get("mamba_expand") or cfg.get("expand") or 2)
    if cfg.get("model_type") in _MAMBA1:
        inner = int(expand * hidden)
        return inner * d_state * state_b + inner * d_conv * kv_b
    heads = cfg.get("mamba_n_heads") or cfg.get("mamba_num_heads") or cfg.get("n_mamba_heads")
    head_dim = cfg.get("mamba_d_head") or cfg.get("mamba_head_dim")
    if cfg.get("mamba_d_ssm"):
        inner = int(cfg["mamba_d_ssm"])
    elif heads and isinstance(head_dim, int):
        inner = int(heads) * head_dim
    else:
        inner = int(expand * hidden)
    groups = int(cfg.get("mamba_n_groups") or cfg.get("n_groups") or cfg.get("mamba_ngroups") or 1)
    return inner * d_state * state_b + (inner + 2 * groups * d_state) * d_conv * kv_b


def _linear_state_bytes(cfg: dict, kv_b: int, state_b: int) -> int:
    lin = cfg.get("linear_attn_config") or {}
    if lin or cfg.get("model_type") == "kimi_linear":  # KDA: per-head dk x dv state, conv over q, k and v
        h = int(lin.get("num_heads", cfg.get("linear_num_heads", 32)))
        d = int(lin.get("head_dim", cfg.get("linear_head_dim", 128)))
        kernel = int(lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)))
        return h * d * d * state_b + 3 * h * d * kernel * kv_b
    if cfg.get("model_type") == "bailing_hybrid":  # KDA over the attention heads
        h, d = int(cfg["num_attention_heads"]), int(cfg.get("head_dim", 128))
        return h * d * d * state_b + 3 * h * d * int(cfg.get("short_conv_kernel_size", 4)) * kv_b
    if "linear_num_value_heads" in cfg:  # Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-Hybrid)
        nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
        conv = (2 * nk * dk + nv * dv) * int(cfg.get("linear_conv_kernel_dim", 4)) * kv_b
        return nv * dk * dv * state_b + conv
    if cfg.get("model_type") == "gated_deltanet":  # fla's own GDN configs
        h, dk = int(cfg["num_heads"]), int(cfg["head_dim"])
        dv = int(dk * float(cfg.get("expand_v", 2)))
        conv = (2 * h * dk + h * dv) * int(cfg.get("conv_size", 4)) * kv_b if cfg.get("use_short_conv", True) else 0
        return h * dk * dv * state_b + conv
    return heads_state(cfg, state_b)  # lightning attention (Ring, MiniMax): MHA state, no conv


def heads_state(cfg: dict, state_b: int) -> int:
    d = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    return int(cfg["num_attention_heads"]) * d * d * state_b
