"""A model's state: one ``LayerState`` per stateful part of a layer, in named tensor slots, read out of a
transformers Cache (``host_copy.build_cache`` puts it back), and its sizes (``KVProfile``).

- FULL_ATTENTION: ``keys``/``values`` of every token, ``[batch, heads, tokens, dim]``; can be sliced to a range.
- SLIDING_WINDOW: ``keys``/``values`` of the last ``window - 1`` tokens, and the length they end at.
- LINEAR_ATTENTION: ``conv.<i>`` and ``recurrent.<i>``; fixed size, valid at exactly one length.

A layer with attention beside a Mamba mixer holds two parts, an MLP-only layer none. ``LayerState.layer`` is the
part's index, which the wire and the pool count as a layer. A slot goes on the wire as it is (``tensor_bytes``),
with a one-byte dtype code and a ``checksum``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import torch
import xxhash

if TYPE_CHECKING:  # transformers takes seconds to import: only the functions that touch a Cache load it
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache


class StateKind(IntEnum):
    FULL_ATTENTION = 1
    SLIDING_WINDOW = 2
    LINEAR_ATTENTION = 3

    @property
    def grows(self) -> bool:
        return self is StateKind.FULL_ATTENTION


@dataclass(frozen=True, slots=True)
class LayerState:
    """One layer's state after ``seq_len`` tokens. Slots are (name, tensor) in a fixed order."""

    layer: int
    kind: StateKind
    seq_len: int
    slots: tuple[tuple[str, torch.Tensor], ...]

    def __post_init__(self) -> None:
        if self.layer < 0 or self.seq_len < 0:
            raise ValueError(f"layer and seq_len must be >= 0, got {self.layer}, {self.seq_len}")
        if not self.slots:
            raise ValueError(f"layer {self.layer}: a state needs at least one tensor slot")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.slots)

    def tensor(self, name: str) -> torch.Tensor:
        for slot_name, t in self.slots:
            if slot_name == name:
                return t
        raise KeyError(f"layer {self.layer} has no slot {name!r}")

    def slice_tokens(self, start: int, end: int) -> LayerState:
        """The full-attention KV of tokens [start, end); other kinds only at their exact length."""
        if not 0 <= start <= end <= self.seq_len:
            raise ValueError(f"token range [{start}, {end}) outside 0..{self.seq_len}")
        if self.kind is not StateKind.FULL_ATTENTION:
            if (start, end) != (0, self.seq_len):
                raise ValueError(f"a {self.kind.name} state is only valid at length {self.seq_len}, not a slice")
            return self
        slots = tuple((n, t[..., start:end, :]) for n, t in self.slots)
        return LayerState(self.layer, self.kind, end - start, slots)


@dataclass(slots=True)
class ModelState:
    """All layers of one request's state, at ``seq_len`` tokens."""

    layers: list[LayerState]
    seq_len: int

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)


DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float64,
    5: torch.int8,
    6: torch.uint8,
    7: torch.int32,
    8: torch.int64,
    9: torch.float8_e4m3fn,
    10: torch.float8_e5m2,
    11: torch.bool,
    12: torch.int16,
}
DTYPE_CODES: dict[torch.dtype, int] = {v: k for k, v in DTYPES.items()}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a host tensor's memory (copied only if it is not contiguous). A device tensor is refused:
    this runs on event loops, where a ``.cpu()`` would block (``host_copy`` stages states off the loop)."""
    if t.device.type != "cpu":
        raise ValueError(f"a {t.device} tensor reached the byte codec: stage it to host memory first (host_copy)")
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


_GIL_FREE_BYTES = 64 << 10  # from here on hash with the GIL released (the one-shot function holds it)


def checksum(buf: memoryview | bytes) -> int:
    if len(buf) < _GIL_FREE_BYTES:
        return xxhash.xxh3_64_intdigest(buf) & 0xFFFFFFFF
    # the streaming hasher gives the same digest and lets other threads (an event loop) run meanwhile
    return xxhash.xxh3_64(buf).intdigest() & 0xFFFFFFFF


class Checksum:
    """``checksum`` of bytes fed in pieces, e.g. each block a socket read, while it is still in cache."""

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_64()

    def update(self, buf: memoryview | bytes) -> None:
        self._hasher.update(buf)

    @property
    def value(self) -> int:
        return self._hasher.intdigest() & 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class StatePart:
    layer: int  # the decoder layer
    kind: StateKind


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Which parts each decoder layer holds (``state_layout.layout_of`` finds them at start-up)."""

    parts: tuple[StatePart, ...]
    num_layers: int  # decoder layers, stateless ones included

    @property
    def kinds(self) -> tuple[StateKind, ...]:
        return tuple(p.kind for p in self.parts)

    def parts_of(self, layer: int) -> list[int]:
        """Indices of decoder layer ``layer``'s parts (consecutive; none for a layer without state)."""
        return [i for i, p in enumerate(self.parts) if p.layer == layer]

    def extract(self, cache: Cache, layer: int, seq_len: int) -> list[LayerState]:
        """Decoder layer ``layer``'s parts, read out of ``cache`` after ``seq_len`` tokens, not copied: a later
        forward replaces full-attention KV but updates sliding-window and linear states in place."""
        cache_layer = cache.layers[layer]
        return [_read(cache_layer, i, self.parts[i].kind, seq_len) for i in self.parts_of(layer)]


def new_cache(config: PreTrainedConfig, layers: Sequence[object] | None = None) -> Cache:
    """An empty cache of the kind the model of ``config`` runs on; over ``layers`` if given (a batch's rows)."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    if getattr(config, "model_type", None) == "minimax":
        return _lightning_cache_type()(layers or DynamicCache(config=config).layers)
    return DynamicCache(config=config) if layers is None else Cache(layers=list(layers))


@functools.cache
def _lightning_cache_type() -> type:
    """MiniMax's own cache type (its model refuses any other), with the lightning-attention state kept in
    the standard linear cache layers, so that reading, writing and batching it is the same as for any
    other linear state."""
    from transformers.cache_utils import Cache
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class LightningCache(MiniMaxCache):
        def __init__(self, layers: Sequence[object]) -> None:
            Cache.__init__(self, layers=list(layers))  # not MiniMaxCache's: that one keeps a list of its own
            self.linear_cache = []

        def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
            layer = self.layers[layer_idx]
            return layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None

        def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
            self.layers[layer_idx].update_recurrent_state(linear_cache)  # in place: batch rows are views

        def __len__(self) -> int:
            return len(self.layers)

    return LightningCache


def _read(cache_layer: Any, index: int, kind: StateKind, seq_len: int) -> LayerState:
    if kind is StateKind.LINEAR_ATTENTION:
        slots: list[tuple[str, torch.Tensor]] = []
        for i in range(cache_layer.number_of_states):
            if cache_layer.is_conv_states_initialized[i]:
                slots.append((f"conv.{i}", cache_layer.conv_states[i]))
            if cache_layer.is_recurrent_states_initialized[i]:
                slots.append((f"recurrent.{i}", cache_layer.recurrent_states[i]))
        if not slots:  # RecurrentGemma: the model's own modules hold it, one request's at a time
            raise NotImplementedError(f"part {index}: the model keeps this layer's linear state outside its cache")
        return LayerState(index, kind, seq_len, tuple(slots))
    keys, values = cache_layer.keys, cache_layer.values
    if kind is StateKind.SLIDING_WINDOW:
        if cache_layer.cumulative_length != seq_len:
            raise ValueError(f"part {index}: window ends at {cache_layer.cumulative_length}, expected {seq_len}")
    elif keys.shape[-2] != seq_len:
        raise ValueError(f"part {index}: cache holds {keys.shape[-2]} tokens, expected {seq_len}")
    return LayerState(index, kind, seq_len, (("keys", keys), ("values", values)))


@dataclass(frozen=True, slots=True)
class LayerCost:
    kind: str
    bytes_per_token: int  # growing part, one layer
    fixed_bytes: int  # per request, one layer
    window: int | None = None  # tokens kept, for sliding layers


@dataclass(frozen=True, slots=True)
class KVProfile:
    """A model's state sizes, layer by layer (``kv_size.kv_profile`` reads them from a config)."""

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
