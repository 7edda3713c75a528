"""A transformers Cache whose rows are independent requests of different lengths.

One decode step feeds one token per row. Each model layer keeps its rows in a row layer (``row_layers``), row r
of every buffer belonging to the same request. Rows are padded, not paged: with one query token per row,
attention over a padded ``[n, width]`` block is one batched matmul that transformers' own attention functions
run unchanged, and the decoder's token budget caps the padding's cost (n x width). Rows stay packed in
``0..n-1``: a row that leaves is replaced by the last one.

The masks go to the model as a dict keyed by layer type, under the name the config gives it (``layer_types`` or
``layers_block_type``) and a generic one ("full_attention", "sliding_attention", "linear_attention"): the padded
mask, the ring's, or None for a layer with only linear state. A model whose layers all attend alike gets its one
mask as a 4D tensor (older model code such as Qwen3-MoE takes no dict). A cache layer with no row form raises
NotImplementedError; the decode service then runs that model unbatched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from minifaas.model.layer_state import LayerState
from minifaas.model.row_layers import (
    PaddedKVLayer,
    RingKVLayer,
    RowHybridLayer,
    RowLayer,
    RowLinearLayer,
    StatelessRowLayer,
)
from minifaas.model.state_layout import new_cache


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


class BatchCache:
    """The per-layer row buffers of one decode batch, and the masks of its next step."""

    def __init__(self, config: PreTrainedConfig, device: torch.device | str = "cpu") -> None:
        self.config, self.device = config, torch.device(device)
        template = DynamicCache(config=config).layers
        self.layers: list[RowLayer] = [row_layer(t, self.device) for t in template]
        self.mask_of = self._mask_names(config)
        windows = {x.window if isinstance(x, RingKVLayer) else 0 for x in self.layers}
        self.one_mask = len(windows) == 1 and all(type(x) in (PaddedKVLayer, RingKVLayer) for x in self.layers)
        self.cache = new_cache(config, self.layers)  # what the model's forward sees
        self.lengths: list[int] = []  # tokens held per row = the position its next token is written at

    def _mask_names(self, config: PreTrainedConfig) -> dict[str, PaddedKVLayer | None]:
        """Every name a model may look a layer's mask up by -> the layer whose attention the mask is for."""
        out: dict[str, PaddedKVLayer | None] = {}
        for names in (getattr(config, "layer_types", None), getattr(config, "layers_block_type", None)):
            for name, layer in zip(names or (), self.layers):
                out.setdefault(name, layer if isinstance(layer, PaddedKVLayer) else None)
        full = next((x for x in self.layers if isinstance(x, PaddedKVLayer) and not isinstance(x, RingKVLayer)), None)
        ring = next((x for x in self.layers if isinstance(x, RingKVLayer)), None)
        for name, layer in (("full_attention", full), ("sliding_attention", ring), ("linear_attention", None)):
            out.setdefault(name, layer)
        return out

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def check(self, states: Sequence[LayerState]) -> None:
        """Raise ValueError unless ``states`` has every part of every layer, each of its kind."""
        parts = [kind for layer in self.layers for kind in layer.parts]
        if len(states) != len(parts):
            raise ValueError(f"the model's layers hold {len(parts)} states, got {len(states)}")
        for kind, state in zip(parts, states):
            if state.kind is not kind:
                raise ValueError(f"part {state.layer}: expected {kind.name}, got {state.kind.name}")

    def add_row(self, states: Sequence[LayerState], seq_len: int) -> int:
        """Copy one request's state into the next free row; returns the row index."""
        self.check(states)
        row, at = self.rows, 0
        width = max([seq_len, *self.lengths]) + 1
        for layer in self.layers:
            layer.fit(row + 1, width)
            layer.put(row, states[at : at + len(layer.parts)])
            at += len(layer.parts)
        self.lengths.append(seq_len)
        return row

    def remove_row(self, row: int) -> int | None:
        """Free ``row``; the last row moves into its place. Returns the index that moved there, if any."""
        last = self.rows - 1
        moved = None
        if row != last:
            for layer in self.layers:
                layer.move(last, row, self.lengths[last])
            self.lengths[row] = self.lengths[last]
            moved = last
        self.lengths.pop()
        return moved

    def prepare_step(self, dtype: torch.dtype) -> dict[str, torch.Tensor | None] | torch.Tensor:
        """Point every layer at rows 0..n-1 and build the attention masks, by layer type, of the next step:
        the one mask itself if every layer attends alike (``one_mask``)."""
        n = self.rows
        positions = torch.tensor(self.lengths, dtype=torch.long, device=self.device)
        width = max(self.lengths) + 1
        for layer in self.layers:
            layer.prepare(n, positions, width)
        hidden = torch.finfo(dtype).min
        built: dict[int, torch.Tensor] = {}  # one mask per window size (0: full attention)
        masks: dict[str, torch.Tensor | None] = {}
        for name, layer in self.mask_of.items():
            if layer is None:
                masks[name] = None
                continue
            window = layer.window if isinstance(layer, RingKVLayer) else 0
            if window not in built:
                if window:  # slot j holds a token iff j <= p, or the ring is full
                    slots = torch.arange(window, device=self.device)
                    visible = (slots <= positions[:, None]) | (positions[:, None] >= window - 1)
                else:
                    visible = torch.arange(width, device=self.device) <= positions[:, None]
                mask = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill_(~visible, hidden)
                built[window] = mask[:, None, None, :]  # [rows, 1, 1 query, keys]
            masks[name] = built[window]
        return next(iter(built.values())) if self.one_mask else masks

    def advance(self) -> None:
        self.lengths = [n + 1 for n in self.lengths]
