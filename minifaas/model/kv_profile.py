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

    def by_kind(self) -> dict[str, tuple[int, int, int, int | None]]:
        """kind -> (layer count, bytes/token over those layers, fixed bytes over those layers, window)."""
        out: dict[str, tuple[int, int, int, int | None]] = {}
        for c in self.layers:
            n, per_tok, fixed, _ = out.get(c.kind, (0, 0, 0, None))
            out[c.kind] = (n + 1, per_tok + c.bytes_per_token, fixed + c.fixed_bytes, c.window)
        return out
