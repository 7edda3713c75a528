"""Which state parts a model's cache holds, layer by layer, told from transformers' cache layer types once at
start-up; ``layer_state.StateLayout`` then reads each layer's parts out of the cache as a forward runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from minifaas.model.layer_state import StateKind, StateLayout, StatePart, new_cache

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache


def layout_of(config: PreTrainedConfig) -> StateLayout:
    """The layout of the cache the model of ``config`` runs on."""
    return layout_of_cache(new_cache(config))


def layout_of_cache(cache: Cache) -> StateLayout:
    parts = tuple(StatePart(i, kind) for i, layer in enumerate(cache.layers) for kind in part_kinds(layer))
    return StateLayout(parts, len(cache.layers))


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
