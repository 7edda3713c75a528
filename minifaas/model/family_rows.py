"""Row layers for the cache layers only some model families have, and ``row_layer``: each cache layer's row form.

- sliding window, ``RingKVLayer``: ``[rows, heads, window, dim]``, a ring: position p lives in slot ``p % window``
  (attention is order-free once keys carry their rotary phase, so the ring is never shifted).
- attention and linear state in one layer (Falcon-H1, Zamba), ``RowHybridLayer``: both, since the model reaches
  both through the same ``cache.layers[i]``; no state (Nemotron-H's MLP/MoE layers), ``StatelessRowLayer``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from minifaas.model.batch_cache import PaddedKVLayer, RowLayer, RowLinearLayer, fitted, roomy
from minifaas.model.layer_state import LayerState, StateKind


class RingKVLayer(PaddedKVLayer):
    """Sliding-window KV of every row in a ring of ``window`` slots."""

    parts = (StateKind.SLIDING_WINDOW,)

    def __init__(self, window: int, device: torch.device | str) -> None:
        super().__init__(device)
        self.window = window

    def fit(self, rows: int, width: int, shrink: bool = False) -> None:
        for name, buf in self.buffers.items():
            self.buffers[name] = fitted(buf, {0: rows}, shrink)

    def put(self, row: int, states: Sequence[LayerState]) -> None:
        # the last `held` tokens, ending at position seq_len - 1; the next step needs window - 1 of them
        state = states[0]
        held = min(state.tensor("keys").shape[-2], self.window - 1)
        slots = torch.arange(state.seq_len - held, state.seq_len, device=self.device) % self.window
        for name, t in state.slots:
            if name not in self.buffers:
                shape = (roomy(row + 1), t.shape[1], self.window, t.shape[3])
                self.buffers[name] = torch.zeros(shape, dtype=t.dtype, device=self.device)
            self.buffers[name][row, :, slots] = t[0, :, t.shape[-2] - held :].to(self.device)

    def move(self, src: int, dst: int, tokens: int) -> None:
        super().move(src, dst, self.window)

    def prepare(self, rows: int, write_at: torch.Tensor, width: int) -> None:
        super().prepare(rows, write_at % self.window, self.window)


class RowHybridLayer(PaddedKVLayer, RowLinearLayer):
    """A layer's attention KV (padded rows) and its linear state (stacked rows), its two parts in that order."""

    parts = (StateKind.FULL_ATTENTION, StateKind.LINEAR_ATTENTION)

    def __init__(self, number_of_states: int, device: torch.device | str) -> None:
        PaddedKVLayer.__init__(self, device)
        RowLinearLayer.__init__(self, number_of_states, device)

    def fit(self, rows: int, width: int, shrink: bool = False) -> None:
        PaddedKVLayer.fit(self, rows, width, shrink)
        RowLinearLayer.fit(self, rows, width, shrink)

    def put(self, row: int, states: Sequence[LayerState]) -> None:
        PaddedKVLayer.put(self, row, states)
        RowLinearLayer.put(self, row, states)

    def move(self, src: int, dst: int, tokens: int) -> None:
        PaddedKVLayer.move(self, src, dst, tokens)
        RowLinearLayer.move(self, src, dst, tokens)

    def prepare(self, rows: int, write_at: torch.Tensor, width: int) -> None:
        PaddedKVLayer.prepare(self, rows, write_at, width)
        RowLinearLayer.prepare(self, rows, write_at, width)


class StatelessRowLayer(DummyLayer):
    parts: tuple[StateKind, ...] = ()

    def nothing(self, *args: object, **kwargs: object) -> None:
        """A layer without state has nothing to size, put, move or prepare."""

    fit = put = move = prepare = nothing


def row_layer(template: object, device: torch.device) -> RowLayer:
    """The row form of one layer of the cache transformers builds for the model."""
    if type(template) is LinearAttentionAndFullAttentionLayer:
        return RowHybridLayer(template.number_of_states, device)
    if type(template) is LinearAttentionLayer:
        return RowLinearLayer(template.number_of_states, device)
    if type(template) is DynamicSlidingWindowLayer:
        return RingKVLayer(template.sliding_window, device)
    if type(template) is DynamicLayer:
        return PaddedKVLayer(device)
    if type(template) is DummyLayer:
        return StatelessRowLayer()
    raise NotImplementedError(f"no row-batched form of cache layer {type(template).__name__}")
