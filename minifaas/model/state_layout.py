"""Which LayerStates a model's cache holds, and how they are read out of a transformers Cache and put back.

A model's state is one LayerState per stateful part of a decoder layer, in layer order: a layer with attention
beside a Mamba mixer has two (its KV, then its linear state), an MLP-only layer none. ``LayerState.layer`` is the
part's index, which the wire and the pool count as a layer; ``StateLayout.parts[i].layer`` is its decoder layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minifaas.model.host_copy import to_device
from minifaas.model.layer_state import LayerState, StateKind

if TYPE_CHECKING:  # transformers takes seconds to import: only the functions that touch a Cache load it
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache


@dataclass(frozen=True, slots=True)
class StatePart:
    layer: int  # the decoder layer
    kind: StateKind


@dataclass(frozen=True, slots=True)
class StateLayout:
    parts: tuple[StatePart, ...]
    num_layers: int  # decoder layers, stateless ones included

    @classmethod
    def of(cls, config: PreTrainedConfig) -> StateLayout:
        """The layout of the cache the model of ``config`` runs on."""
        return cls.of_cache(new_cache(config))

    @classmethod
    def of_cache(cls, cache: Cache) -> StateLayout:
        parts = tuple(StatePart(i, kind) for i, layer in enumerate(cache.layers) for kind in part_kinds(layer))
        return cls(parts, len(cache.layers))

    @property
    def kinds(self) -> tuple[StateKind, ...]:
        return tuple(p.kind for p in self.parts)

    def parts_of(self, layer: int) -> list[int]:
        """Indices of decoder layer ``layer``'s parts (consecutive; none for a layer without state)."""
        return [i for i, p in enumerate(self.parts) if p.layer == layer]

    def extract(self, cache: Cache, layer: int, seq_len: int, clone_fixed: bool = True) -> list[LayerState]:
        """Decoder layer ``layer``'s parts, read out of ``cache`` after ``seq_len`` tokens. Full-attention KV is
        not copied (transformers replaces it on update); sliding-window and linear states, updated in place by
        later forwards, are cloned unless ``clone_fixed`` is False."""
        keep = (lambda t: t.clone()) if clone_fixed else (lambda t: t)
        cache_layer = cache.layers[layer]
        return [_read(cache_layer, i, self.parts[i].kind, seq_len, keep) for i in self.parts_of(layer)]


def part_kinds(cache_layer: object) -> tuple[StateKind, ...]:
    """The parts one transformers cache layer holds, in the order they are listed."""
    from transformers.cache_utils import (
        DummyLayer,
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionCacheLayerMixin,
    )

    if isinstance(cache_layer, DummyLayer):
        return ()
    if isinstance(cache_layer, DynamicSlidingWindowLayer):
        attention: tuple[StateKind, ...] = (StateKind.SLIDING_WINDOW,)
    elif type(cache_layer) is DynamicLayer or (
        isinstance(cache_layer, DynamicLayer) and isinstance(cache_layer, LinearAttentionCacheLayerMixin)
    ):
        attention = (StateKind.FULL_ATTENTION,)
    elif isinstance(cache_layer, LinearAttentionCacheLayerMixin):
        attention = ()
    else:
        raise NotImplementedError(f"cache layer type {type(cache_layer).__name__} is not supported")
    linear = (StateKind.LINEAR_ATTENTION,) if isinstance(cache_layer, LinearAttentionCacheLayerMixin) else ()
    return attention + linear


def needs_snapshot(kinds: Sequence[StateKind]) -> bool:
    """A model with any fixed-size state can reuse a prefix only where a snapshot was taken."""
    return any(not kind.grows for kind in kinds)


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


def build_cache(config: PreTrainedConfig, states: Sequence[LayerState], device: torch.device | str) -> Cache:
    """A fresh cache holding ``states`` (every part, in order), ready to continue. Tensors are copied onto
    ``device`` even when already there, so the cache never mutates a state someone else holds (a pooled prefix)."""
    cache = new_cache(config)
    layout = StateLayout.of_cache(cache)
    if len(states) != len(layout.parts):
        raise ValueError(f"the model's layers hold {len(layout.parts)} states, got {len(states)}")
    for i, (part, state) in enumerate(zip(layout.parts, states)):
        if state.layer != i:
            raise ValueError(f"state for part {state.layer} given at position {i}")
        if state.kind is not part.kind:
            raise ValueError(f"part {i} (layer {part.layer}): model expects {part.kind.name}, got {state.kind.name}")
        _write(cache.layers[part.layer], state, device)
    return cache


def _read(cache_layer: Any, index: int, kind: StateKind, seq_len: int, keep: Callable) -> LayerState:
    if kind is StateKind.LINEAR_ATTENTION:
        slots: list[tuple[str, torch.Tensor]] = []
        for i in range(cache_layer.number_of_states):
            if cache_layer.is_conv_states_initialized[i]:
                slots.append((f"conv.{i}", keep(cache_layer.conv_states[i])))
            if cache_layer.is_recurrent_states_initialized[i]:
                slots.append((f"recurrent.{i}", keep(cache_layer.recurrent_states[i])))
        if not slots:  # RecurrentGemma: the model's own modules hold it, one request's at a time
            raise NotImplementedError(f"part {index}: the model keeps this layer's linear state outside its cache")
        return LayerState(index, kind, seq_len, tuple(slots))
    keys, values = cache_layer.keys, cache_layer.values
    if kind is StateKind.SLIDING_WINDOW:
        if cache_layer.cumulative_length != seq_len:
            raise ValueError(f"part {index}: window ends at {cache_layer.cumulative_length}, expected {seq_len}")
        return LayerState(index, kind, seq_len, (("keys", keep(keys)), ("values", keep(values))))
    if keys.shape[-2] != seq_len:
        raise ValueError(f"part {index}: cache holds {keys.shape[-2]} tokens, expected {seq_len}")
    return LayerState(index, kind, seq_len, (("keys", keys), ("values", values)))


def _write(cache_layer: Any, state: LayerState, device: torch.device | str) -> None:
    tensors = dict(to_device(state, device).slots)  # asynchronous from pinned memory
    if state.kind is StateKind.LINEAR_ATTENTION:
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
        _count_linear_tokens(cache_layer, state.seq_len)
        return
    keys, values = tensors["keys"], tensors["values"]
    cache_layer.lazy_initialization(keys, values)  # a hybrid layer dispatches two tensors to its attention half
    cache_layer.keys, cache_layer.values = keys, values
    if state.kind is StateKind.SLIDING_WINDOW:
        cache_layer.cumulative_length = state.seq_len


def _count_linear_tokens(cache_layer: Any, seq_len: int) -> None:
    """Set the token count of a layer that keeps one beside its linear state (``cumulative_length_linear``):
    its ``get_seq_length`` returns it, and a model whose first layer is linear takes its positions from that."""
    if hasattr(cache_layer, "cumulative_length_linear"):
        cache_layer.cumulative_length_linear = torch.tensor(seq_len, device=cache_layer.device)
