"""A transformers Cache whose rows are independent requests of different lengths.

One decode step feeds one token per row. Each model layer keeps its rows in
preallocated buffers, row r of every buffer belonging to the same request:

- full attention, ``PaddedKVLayer``: ``[rows, heads, capacity, dim]``, right
  padded. Row r holds its tokens in slots ``0..len_r-1`` and writes the new one
  at slot ``len_r`` (its absolute position). The forward sees the view
  ``[:n, :, :width]`` with ``width`` = longest row + 1, and a mask that hides
  each row's padding. Capacity grows geometrically (x2), so a step copies only
  the n new tokens; a whole row is copied when it joins or moves.
- sliding window, ``RingKVLayer``: ``[rows, heads, window, dim]``, a ring: the
  token at position p lives in slot ``p % window``. Attention is order-free
  once keys carry their rotary phase, so the ring needs no shifting.
- linear attention, ``RowLinearLayer``: conv and recurrent states stacked by
  row, handed to the model as ``[:n]`` views it updates in place.

Why padding and not pages: with one query token per row, attention over a
padded ``[n, width]`` block is a single batched matmul that transformers' own
attention functions (eager and sdpa) run unchanged; a paged layout would need a
gather into the same dense block every step or a kernel of our own. The cost
of padding is compute on masked slots, bounded by n x width; the decoder's
token budget caps exactly that product. Rows stay packed in ``0..n-1``: a row
that leaves is replaced by the last row (one row copy), so no step computes on
holes.

Every preset batches exactly this way (tests compare each row with the same
request decoded alone): KimiLinear's MLA caches its compressed latent and uses
no rotary positions; Qwen3.5, Qwen3 and MiMo-V2 take per-row ``position_ids``
for their rotary phase; MiMo's sliding layers add their attention sinks after
our mask, which they treat like any other. A cache layer with no row form here
(one holding both linear and attention state) raises NotImplementedError, and
the decode service then runs that model unbatched, saying so in its log.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
)

from minifaas.model.layer_state import LayerState, StateKind


def grown(buffer: torch.Tensor, dim: int, needed: int) -> torch.Tensor:
    """``buffer`` if dimension ``dim`` holds ``needed``; else a copy at least twice as large (zeros after)."""
    if buffer.shape[dim] >= needed:
        return buffer
    shape = list(buffer.shape)
    shape[dim] = max(needed, 2 * buffer.shape[dim])
    out = buffer.new_zeros(shape)
    out.narrow(dim, 0, buffer.shape[dim]).copy_(buffer)
    return out


class PaddedKVLayer(CacheLayerMixin):
    """Full-attention KV of every row, right padded to a shared capacity."""

    kind = StateKind.FULL_ATTENTION

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.buffers: dict[str, torch.Tensor] = {}  # "keys"/"values": [rows, heads, capacity, dim]
        self.rows, self.width = 0, 0
        self.write_at = torch.zeros(0, dtype=torch.long)

    def put(self, row: int, state: LayerState) -> None:
        for name, t in state.slots:
            if name not in self.buffers:
                self.buffers[name] = torch.zeros((row + 1, *t.shape[1:]), dtype=t.dtype, device=self.device)
            buf = self.buffers[name]
            buf = grown(buf, 0, row + 1)
            buf = grown(buf, 2, state.seq_len)
            buf[row, :, : state.seq_len].copy_(t[0])
            self.buffers[name] = buf

    def move(self, src: int, dst: int, tokens: int) -> None:
        for buf in self.buffers.values():
            buf[dst, :, :tokens].copy_(buf[src, :, :tokens])

    def prepare(self, rows: int, write_at: torch.Tensor, width: int) -> None:
        self.rows, self.write_at, self.width = rows, write_at, width
        for name, buf in self.buffers.items():
            self.buffers[name] = grown(buf, 2, width)
        self.keys, self.values = self.buffers.get("keys"), self.buffers.get("values")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [rows, heads, 1, dim], one new token per row, written at each row's own position
        index = torch.arange(self.rows, device=self.device)
        for name, new in (("keys", key_states), ("values", value_states)):
            self.buffers[name][index, :, self.write_at] = new[:, :, 0]
        n, w = self.rows, self.width
        return self.buffers["keys"][:n, :, :w], self.buffers["values"][:n, :, :w]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("rows are added with put(), not by a forward")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width, 0

    def get_seq_length(self) -> int:
        return self.width - 1

    def get_max_length(self) -> int:
        return -1


class RingKVLayer(PaddedKVLayer):
    """Sliding-window KV of every row in a ring of ``window`` slots."""

    kind = StateKind.SLIDING_WINDOW

    def __init__(self, window: int, device: torch.device | str) -> None:
        super().__init__(device)
        self.window = window

    def put(self, row: int, state: LayerState) -> None:
        # the last `held` tokens, ending at position seq_len - 1; the next step needs window - 1 of them
        held = min(state.tensor("keys").shape[-2], self.window - 1)
        slots = torch.arange(state.seq_len - held, state.seq_len, device=self.device) % self.window
        for name, t in state.slots:
            if name not in self.buffers:
                shape = (row + 1, t.shape[1], self.window, t.shape[3])
                self.buffers[name] = torch.zeros(shape, dtype=t.dtype, device=self.device)
            buf = grown(self.buffers[name], 0, row + 1)
            buf[row, :, slots] = t[0, :, t.shape[-2] - held :].to(self.device)
            self.buffers[name] = buf

    def move(self, src: int, dst: int, tokens: int) -> None:
        super().move(src, dst, self.window)

    def prepare(self, rows: int, write_at: torch.Tensor, width: int) -> None:
        super().prepare(rows, write_at % self.window, self.window)


class RowLinearLayer(LinearAttentionLayer):
    """Conv and recurrent states of every row, stacked; the model updates the [:n] views in place."""

    kind = StateKind.LINEAR_ATTENTION

    def __init__(self, number_of_states: int, device: torch.device | str) -> None:
        super().__init__(number_of_states=number_of_states)
        self.device = torch.device(device)
        self.buffers: dict[str, torch.Tensor] = {}  # "conv.<i>" / "recurrent.<i>": [rows, ...]

    def put(self, row: int, state: LayerState) -> None:
        for name, t in state.slots:
            if name not in self.buffers:
                self.buffers[name] = torch.zeros((row + 1, *t.shape[1:]), dtype=t.dtype, device=self.device)
            buf = grown(self.buffers[name], 0, row + 1)
            buf[row].copy_(t[0])
            self.buffers[name] = buf

    def move(self, src: int, dst: int, tokens: int) -> None:
        for buf in self.buffers.values():
            buf[dst].copy_(buf[src])

    def prepare(self, rows: int, write_at: torch.Tensor, width: int) -> None:
        for name, buf in self.buffers.items():
            which, idx = name.split(".")
            i = int(idx)
            if which == "conv":
                self.conv_states[i] = buf[:rows]
                self.conv_kernel_size[i] = buf.shape[-1]
                self.is_conv_states_initialized[i] = True
            else:
                self.recurrent_states[i] = buf[:rows]
                self.is_recurrent_states_initialized[i] = True
            self.has_previous_state[i] = True
            self.dtype = buf.dtype


RowLayer = PaddedKVLayer | RowLinearLayer


class BatchCache:
    """The per-layer row buffers of one decode batch, and the masks of its next step."""

    def __init__(self, config: PreTrainedConfig, device: torch.device | str = "cpu") -> None:
        self.config, self.device = config, torch.device(device)
        template = DynamicCache(config=config).layers
        self.layers: list[RowLayer] = [self._row_layer(t, self.device) for t in template]
        self.layer_types: list[str] = list(getattr(config, "layer_types", None) or ["full_attention"] * len(template))
        self.cache = Cache(layers=self.layers)  # what the model's forward sees
        self.lengths: list[int] = []  # tokens held per row = the position its next token is written at

    @staticmethod
    def _row_layer(template: object, device: torch.device) -> RowLayer:
        if isinstance(template, LinearAttentionLayer):
            return RowLinearLayer(template.number_of_states, device)
        if isinstance(template, DynamicSlidingWindowLayer):
            return RingKVLayer(template.sliding_window, device)
        if type(template) is DynamicLayer:
            return PaddedKVLayer(device)
        raise NotImplementedError(f"no row-batched form of cache layer {type(template).__name__}")

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def check(self, states: Sequence[LayerState]) -> None:
        """Raise ValueError unless ``states`` has one state per layer, each of the layer's kind."""
        if len(states) != len(self.layers):
            raise ValueError(f"model has {len(self.layers)} layers, got {len(states)} states")
        for layer, state in zip(self.layers, states):
            if state.kind is not layer.kind:
                raise ValueError(f"layer {state.layer}: expected {layer.kind.name}, got {state.kind.name}")

    def add_row(self, states: Sequence[LayerState], seq_len: int) -> int:
        """Copy one request's state into the next free row; returns the row index."""
        self.check(states)
        row = self.rows
        for layer, state in zip(self.layers, states):
            layer.put(row, state)
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

    def prepare_step(self, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
        """Point every layer at rows 0..n-1 and build the attention masks, by layer type, of the next step."""
        n = self.rows
        positions = torch.tensor(self.lengths, dtype=torch.long, device=self.device)
        width = max(self.lengths) + 1
        for layer in self.layers:
            layer.prepare(n, positions, width)
        hidden = torch.finfo(dtype).min
        masks: dict[str, torch.Tensor | None] = {}
        for layer, layer_type in zip(self.layers, self.layer_types):
            if layer_type in masks:  # one mask serves every layer of a type
                continue
            if isinstance(layer, RingKVLayer):  # slot j holds a token iff j <= p, or the ring is full
                slots = torch.arange(layer.window, device=self.device)
                visible = (slots <= positions[:, None]) | (positions[:, None] >= layer.window - 1)
            elif isinstance(layer, PaddedKVLayer):
                visible = torch.arange(width, device=self.device) <= positions[:, None]
            else:
                masks[layer_type] = None
                continue
            mask = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill_(~visible, hidden)
            masks[layer_type] = mask[:, None, None, :]  # [rows, 1, 1 query, keys]
        return masks

    def advance(self) -> None:
        self.lengths = [n + 1 for n in self.lengths]
