"""What a decode worker's memory holds: ``max_batch`` and the step's KV budget when they are left at 0 (auto).

The batch gets ``MEMORY_SHARE`` of the memory the worker has when it starts. The step's budget is the KV slots
(one token's full-attention K and V) that fit in it; ``max_batch`` is the rows of ``ROW_CONTEXT`` tokens and
their fixed state that fit, at most ``MAX_ROWS``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minifaas.model.decoder import DecoderConfig
from minifaas.model.host_memory import available_bytes
from minifaas.model.kv_size import kv_profile
from minifaas.model.layer_state import KVProfile
from minifaas.model.loader import load_config_dict
from minifaas.model.runtime import ModelRuntime

MEMORY_SHARE = 0.5
MAX_ROWS = 1024
ROW_CONTEXT = 2048  # tokens of context a row is sized for
GROWING = ("full_attention", "mla", "attention+mamba")  # kinds whose state grows with every token


@dataclass(frozen=True, slots=True)
class RowBytes:
    """The bytes of one decode row: fixed, and per token of its padded context."""

    fixed: int
    per_token: int

    @classmethod
    def of(cls, profile: KVProfile) -> RowBytes:
        per_token = sum(c.bytes_per_token for c in profile.layers if c.kind in GROWING)
        windows = sum(c.bytes_per_token * (c.window or 0) for c in profile.layers if c.kind not in GROWING)
        return cls(sum(c.fixed_bytes for c in profile.layers) + windows, per_token)

    def rows(self, memory: int, context: int = ROW_CONTEXT) -> int:
        return max(1, memory // max(1, self.fixed + self.per_token * context))

    def slots(self, memory: int) -> int:
        return max(1, memory // self.per_token) if self.per_token else 1 << 40


def sized(config: DecoderConfig, row: RowBytes, memory: int) -> DecoderConfig:
    """``config`` with its auto (0) ``max_batch`` and ``step_token_budget`` sized for ``memory`` bytes."""
    share = int(memory * MEMORY_SHARE)
    max_batch = config.max_batch or min(MAX_ROWS, row.rows(share))
    budget = config.step_token_budget or row.slots(share)
    return replace(config, max_batch=max_batch, step_token_budget=budget)


def sized_for(config: DecoderConfig, runtime: ModelRuntime) -> DecoderConfig:
    """``config`` sized for ``runtime``'s model with the memory its device has now, if it leaves anything to size."""
    if config.max_batch and config.step_token_budget:
        return config
    return sized(config, row_bytes(runtime), device_memory(runtime.device))


def row_bytes(runtime: ModelRuntime) -> RowBytes:
    """A loaded model's row size, in the dtype it runs in."""
    dtype = str(runtime.model.dtype).removeprefix("torch.")
    return RowBytes.of(kv_profile(load_config_dict(runtime.spec), dtype=dtype))


def device_memory(device: str) -> int:
    """Bytes a new allocation can still get on ``device``: host memory, or on a GPU the free memory within this
    process's share (``torch.cuda.set_per_process_memory_fraction``, which the worker sets) less what it holds."""
    if not device.startswith("cuda"):
        return available_bytes()
    dev = torch.device(device)
    free, total = torch.cuda.mem_get_info(dev)
    share = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(dev)  # absent before torch 2.8
    return within_share(free, total, share, torch.cuda.memory_reserved(dev))


def within_share(free: int, total: int, fraction: float, reserved: int) -> int:
    """What a process capped at ``fraction`` of a card of ``total`` bytes, holding ``reserved``, may still take:
    never more than the card has free (other processes take from it too)."""
    return max(0, min(int(free), int(fraction * total) - int(reserved)))
