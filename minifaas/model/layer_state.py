"""Per-layer model state: the unit that prefill produces and decode consumes.

A hybrid model keeps three kinds of per-layer state, each in named tensor slots:

- FULL_ATTENTION: ``keys``/``values`` of every token, ``[batch, heads, tokens, dim]``.
  Grows with the prompt; can be sliced to a token range (prefix reuse,
  incremental transfer). MLA keeps its compressed latent here.
- SLIDING_WINDOW: ``keys``/``values`` of the last ``window - 1`` tokens plus the
  absolute length they end at. Bounded size.
- LINEAR_ATTENTION: ``conv.<i>`` (short-convolution tail) and ``recurrent.<i>``
  (the linear-attention / SSM state). Fixed size, valid at exactly one length.

``extract_layer`` reads one layer out of a transformers ``Cache``;
``build_cache`` puts a list of them back into a fresh ``DynamicCache`` that the
same model can continue from. The byte codec lives in ``state_codec``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers takes seconds to import: only the functions that touch a Cache load it
    from transformers import DynamicCache, PreTrainedConfig


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

    def to(self, device: torch.device | str) -> LayerState:
        slots = tuple((n, t.to(device)) for n, t in self.slots)
        return LayerState(self.layer, self.kind, self.seq_len, slots)


def concat_tokens(head: LayerState, tail: LayerState) -> LayerState:
    """Join a full-attention prefix with the KV of the tokens that follow it."""
    if head.kind is not StateKind.FULL_ATTENTION or tail.kind is not StateKind.FULL_ATTENTION:
        raise ValueError("only full-attention states concatenate along tokens")
    if head.layer != tail.layer or [n for n, _ in head.slots] != [n for n, _ in tail.slots]:
        raise ValueError(f"cannot join layer {head.layer} with layer {tail.layer}")
    slots = tuple((n, torch.cat([a, b], dim=-2)) for (n, a), (_, b) in zip(head.slots, tail.slots))
    return LayerState(head.layer, head.kind, head.seq_len + tail.seq_len, slots)


@dataclass(slots=True)
class ModelState:
    """All layers of one request's state, at ``seq_len`` tokens."""

    layers: list[LayerState]
    seq_len: int
    extras: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)

    def bytes_by_kind(self) -> dict[StateKind, int]:
        out: dict[StateKind, int] = {}
        for s in self.layers:
            out[s.kind] = out.get(s.kind, 0) + s.nbytes
        return out


def extract_layer(cache: object, layer: int, seq_len: int, clone_fixed: bool = True) -> LayerState:
    """Read layer ``layer`` of a transformers Cache, after ``seq_len`` tokens, as a LayerState.

    Full-attention KV is not copied: transformers replaces (never mutates) it on
    update. Sliding-window and linear states are updated in place by later
    forwards, so they are cloned unless ``clone_fixed`` is False.
    """
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    cache_layer = cache.layers[layer]  # type: ignore[attr-defined]
    keep = (lambda t: t.clone()) if clone_fixed else (lambda t: t)
    if isinstance(cache_layer, LinearAttentionCacheLayerMixin):
        if isinstance(cache_layer, DynamicLayer):
            raise NotImplementedError("layers with both linear and attention state are not supported yet")
        slots: list[tuple[str, torch.Tensor]] = []
        for i in range(cache_layer.number_of_states):
            if cache_layer.is_conv_states_initialized[i]:
                slots.append((f"conv.{i}", keep(cache_layer.conv_states[i])))
            if cache_layer.is_recurrent_states_initialized[i]:
                slots.append((f"recurrent.{i}", keep(cache_layer.recurrent_states[i])))
        return LayerState(layer, StateKind.LINEAR_ATTENTION, seq_len, tuple(slots))
    if isinstance(cache_layer, DynamicSlidingWindowLayer):
        slots = (("keys", keep(cache_layer.keys)), ("values", keep(cache_layer.values)))
        if cache_layer.cumulative_length != seq_len:
            raise ValueError(f"layer {layer}: window ends at {cache_layer.cumulative_length}, expected {seq_len}")
        return LayerState(layer, StateKind.SLIDING_WINDOW, seq_len, slots)
    if isinstance(cache_layer, DynamicLayer):
        k, v = cache_layer.keys, cache_layer.values
        if k.shape[-2] != seq_len:
            raise ValueError(f"layer {layer}: cache holds {k.shape[-2]} tokens, expected {seq_len}")
        return LayerState(layer, StateKind.FULL_ATTENTION, k.shape[-2], (("keys", k), ("values", v)))
    raise NotImplementedError(f"cache layer type {type(cache_layer).__name__} is not supported")


def build_cache(config: PreTrainedConfig, states: Sequence[LayerState], device: torch.device | str) -> DynamicCache:
    """A fresh DynamicCache holding ``states`` (one per layer, in order), ready to continue.

    Tensors are copied onto ``device`` (a no-op copy is still a copy), so the
    cache never mutates a state that someone else holds, e.g. a pooled prefix.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if len(states) != len(cache.layers):
        raise ValueError(f"model has {len(cache.layers)} cache layers, got {len(states)} states")
    for i, (cache_layer, state) in enumerate(zip(cache.layers, states)):
        if state.layer != i:
            raise ValueError(f"state for layer {state.layer} given at position {i}")
        _fill_layer(cache_layer, state, device)
    return cache


def _fill_layer(cache_layer: object, state: LayerState, device: torch.device | str) -> None:
    from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    tensors = {n: t.to(device, copy=True) for n, t in state.slots}
    if isinstance(cache_layer, LinearAttentionCacheLayerMixin):
        if state.kind is not StateKind.LINEAR_ATTENTION:
            raise ValueError(f"layer {state.layer}: model expects linear state, got {state.kind.name}")
        for name, t in tensors.items():
            which, idx = name.split(".")
            i = int(idx)
            if which == "conv":
                cache_layer.conv_states[i] = t
                cache_layer.conv_kernel_size[i] = t.shape[-1]
                cache_layer.is_conv_states_initialized[i] = True
            else:
                cache_layer.recurrent_states[i] = t
                cache_layer.is_recurrent_states_initialized[i] = True
            cache_layer.has_previous_state[i] = True
            cache_layer.device, cache_layer.dtype = t.device, t.dtype
        return
    expected = (
        StateKind.SLIDING_WINDOW if isinstance(cache_layer, DynamicSlidingWindowLayer) else StateKind.FULL_ATTENTION
    )
    if state.kind is not expected:
        raise ValueError(f"layer {state.layer}: model expects {expected.name}, got {state.kind.name}")
    keys, values = tensors["keys"], tensors["values"]
    cache_layer.lazy_initialization(keys, values)
    cache_layer.keys, cache_layer.values = keys, values
    if expected is StateKind.SLIDING_WINDOW:
        cache_layer.cumulative_length = state.seq_len
