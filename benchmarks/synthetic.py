"""Synthetic model states with the shape of a hybrid model, for the transport's tests and benchmarks.

Three linear-attention layers then one full-attention layer, repeated, like a
3:1 KDA:MLA stack, with several dtypes, so nothing in the transport can
depend on a real model or on float32.
"""

from __future__ import annotations

import torch

from minifaas.model.layer_state import LayerState, ModelState, StateKind


def synthetic_state(layers: int = 8, tokens: int = 64, width: int = 16, seed: int = 0) -> ModelState:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(layers):
        if i % 4 == 3:
            keys = torch.randn(1, 2, tokens, width, generator=g)
            values = torch.randn(1, 2, tokens, width, generator=g).to(torch.bfloat16)
            out.append(LayerState(i, StateKind.FULL_ATTENTION, tokens, (("keys", keys), ("values", values))))
        elif i % 4 == 2:
            keys = torch.randn(1, 2, min(tokens, 8), width, generator=g).half()
            values = torch.randint(-128, 127, (1, 2, min(tokens, 8), width), generator=g, dtype=torch.int8)
            out.append(LayerState(i, StateKind.SLIDING_WINDOW, tokens, (("keys", keys), ("values", values))))
        else:
            conv = torch.randn(1, 4 * width, 4, generator=g).half()
            recurrent = torch.randn(1, 2, width, width, generator=g, dtype=torch.float64)
            slots = (("conv.0", conv), ("recurrent.0", recurrent))
            out.append(LayerState(i, StateKind.LINEAR_ATTENTION, tokens, slots))
    return ModelState(out, tokens)


def bulk_state(total_bytes: int, layers: int = 8, seed: int = 0) -> ModelState:
    """About ``total_bytes`` of full-attention KV spread evenly over ``layers`` (for throughput runs)."""
    per_slot = max(total_bytes // (2 * layers), 4)
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 255, (per_slot,), generator=g, dtype=torch.uint8)
    tokens = per_slot // 4
    kv = block[: tokens * 4].view(torch.float32).reshape(1, 1, tokens, 1)
    out = [LayerState(i, StateKind.FULL_ATTENTION, tokens, (("keys", kv), ("values", kv))) for i in range(layers)]
    return ModelState(out, tokens)
