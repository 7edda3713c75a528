"""A model's state sizes: each layer's bytes per token and fixed bytes, and what a request of a length carries."""

from __future__ import annotations

from dataclasses import dataclass


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
