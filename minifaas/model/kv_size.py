"""How many bytes of state a request carries, from a config.json alone.

Reads the raw config dict (no transformers, no weights), so it works for any
real model's config.json as well as for the presets. Each layer is one of:

    full_attention   GQA K+V per token                 grows with length
    mla              compressed latent + rope key      grows with length
    sliding_window   K+V of the last `window` tokens   bounded
    linear           recurrent state + short-conv tail fixed
    conv             short-conv tail only              fixed

Conventions match what the runtime actually holds (transformers' caches): a
conv tail keeps `kernel` columns, a sliding window keeps `window` tokens, and a
recurrent state is float32 unless the config names its dtype. Tests compare
these numbers with the bytes of real prefilled states of every preset.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8": 1}


@dataclass(frozen=True, slots=True)
class LayerCost:
    kind: str
    bytes_per_token: int  # growing part, one layer
    fixed_bytes: int  # per request, one layer
    window: int | None = None  # tokens kept, for sliding layers


@dataclass(frozen=True, slots=True)
class KVProfile:
    name: str
    layers: tuple[LayerCost, ...]

    def bytes_at(self, length: int) -> int:
        total = 0
        for c in self.layers:
            tokens = min(length, c.window) if c.window is not None else length
            total += c.fixed_bytes + c.bytes_per_token * tokens
        return total

    def by_kind(self) -> dict[str, tuple[int, int, int, int | None]]:
        """kind -> (layer count, bytes/token over those layers, fixed bytes over those layers, window)."""
        out: dict[str, tuple[int, int, int, int | None]] = {}
        for c in self.layers:
            n, per_tok, fixed, _ = out.get(c.kind, (0, 0, 0, None))
            out[c.kind] = (n + 1, per_tok + c.bytes_per_token, fixed + c.fixed_bytes, c.window)
        return out


def kv_profile(cfg: dict, name: str = "") -> KVProfile:
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    n = int(cfg["num_hidden_layers"])
    kv_b = DTYPE_BYTES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"), 2)
    state_b = DTYPE_BYTES.get(str(cfg.get("mamba_ssm_dtype", "float32")), 4)
    return KVProfile(
        name or cfg.get("model_type", "model"), tuple(_layer_cost(cfg, k, kv_b, state_b) for k in layer_kinds(cfg, n))
    )


def layer_kinds(cfg: dict, n: int) -> list[str]:
    """One of full / sliding / linear / conv / parallel per layer, from whichever key the config uses."""
    if isinstance(cfg.get("layer_types"), list):
        names = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear", "conv": "conv"}
        return [names.get(t, "full") for t in cfg["layer_types"]]
    lin = cfg.get("linear_attn_config") or {}
    if "full_attn_layers" in lin:  # Kimi Linear, 1-based
        full = set(lin["full_attn_layers"])
        return ["full" if i + 1 in full else "linear" for i in range(n)]
    if isinstance(cfg.get("hybrid_layer_pattern"), list):  # MiMo: 1 = sliding
        return ["sliding" if p else "full" for p in cfg["hybrid_layer_pattern"]]
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
    if cfg.get("model_type") == "gated_deltanet":
        return ["linear"] * n
    return ["full"] * n


def _layer_cost(cfg: dict, kind: str, kv_b: int, state_b: int) -> LayerCost:
    heads = int(cfg.get("num_attention_heads", 1))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if kind == "full":
        if cfg.get("kv_lora_rank"):
            return LayerCost("mla", (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])) * kv_b, 0)
        v_dim = int(cfg.get("v_head_dim") or head_dim)
        return LayerCost("full_attention", kv_heads * (head_dim + v_dim) * kv_b, 0)
    if kind == "sliding":
        swa_heads = int(cfg.get("swa_num_key_value_heads") or 2 * kv_heads)  # transformers' MiMo doubles them
        k_dim = int(cfg.get("swa_head_dim") or head_dim)
        v_dim = int(cfg.get("swa_v_head_dim") or cfg.get("v_head_dim") or head_dim)
        window = int(cfg.get("sliding_window_size") or int(cfg["sliding_window"]) - 1)
        return LayerCost("sliding_window", swa_heads * (k_dim + v_dim) * kv_b, 0, window)
    if kind == "linear":
        return LayerCost("linear", 0, _linear_state_bytes(cfg, kv_b, state_b))
    if kind == "conv":
        return LayerCost("conv", 0, int(cfg["conv_dim"]) * int(cfg["conv_L_cache"]) * kv_b)
    if kind == "parallel":  # Falcon-H1: attention and Mamba2 side by side in every layer
        h, d, s = int(cfg["mamba_n_heads"]), int(cfg["mamba_d_head"]), int(cfg["mamba_d_state"])
        conv = (h * d + 2 * int(cfg.get("mamba_n_groups", 1)) * s) * int(cfg.get("mamba_d_conv", 4)) * kv_b
        return LayerCost("attention+mamba2", kv_heads * 2 * head_dim * kv_b, h * d * s * state_b + conv)
    raise ValueError(f"unknown layer kind {kind!r}")


def _linear_state_bytes(cfg: dict, kv_b: int, state_b: int) -> int:
    lin = cfg.get("linear_attn_config") or {}
    if lin or cfg.get("model_type") == "kimi_linear":  # KDA: per-head dk x dv state, conv over q, k and v
        h = int(lin.get("num_heads", cfg.get("linear_num_heads", 32)))
        d = int(lin.get("head_dim", cfg.get("linear_head_dim", 128)))
        kernel = int(lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)))
        return h * d * d * state_b + 3 * h * d * kernel * kv_b
    if "linear_num_value_heads" in cfg:  # Gated DeltaNet (Qwen3-Next, Qwen3.5)
        nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
        conv = (2 * nk * dk + nv * dv) * int(cfg.get("linear_conv_kernel_dim", 4)) * kv_b
        return nv * dk * dv * state_b + conv
    if cfg.get("model_type") == "gated_deltanet":  # fla's own GDN configs
        h, dk = int(cfg["num_heads"]), int(cfg["head_dim"])
        dv = int(dk * float(cfg.get("expand_v", 2)))
        conv = (2 * h * dk + h * dv) * int(cfg.get("conv_size", 4)) * kv_b if cfg.get("use_short_conv", True) else 0
        return h * dk * dv * state_b + conv
    return heads_state(cfg, state_b)  # lightning attention (Ring): MHA state, no conv


def heads_state(cfg: dict, state_b: int) -> int:
    d = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    return int(cfg["num_attention_heads"]) * d * d * state_b
