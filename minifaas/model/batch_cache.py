"""A transformers Cache whose rows are independent requests of different lengths, for batched decoding.

Each model layer keeps its rows in a row layer (``family_rows.row_layer`` picks its form): sized with ``fit``,
given a request's parts with ``put``, a row moved with ``move``, pointed at rows 0..n-1 by ``prepare`` before each
step. Rows are padded to the longest and stay packed in ``0..n-1`` (a row that leaves is replaced by the last one).
The masks go to the model as a dict by layer type, or as one 4D tensor where all layers attend alike. A cache
layer with no row form raises NotImplementedError, and the decode service then runs that model unbatched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin, DummyLayer, LinearAttentionLayer

from minifaas.model.layer_state import LayerState, StateKind, new_cache

SLACK = 16  # rows or tokens a buffer may hold past four times what it needs: no churn at small sizes
GROWTH = 1024  # up to this many rows a buffer doubles when it grows; past it, it grows by a quarter
SLOT_ROOM = 64  # token slots a grown buffer keeps past its longest row at least
SHRINK_EVERY = 64  # steps between the times a buffer may shrink: one copy per window, not one per long row


def roomy(needed: int, dim: int = 0) -> int:
    """What a buffer's dimension ``dim`` is sized to when it must change. Rows (0): twice ``needed`` while small,
    so rows joining one at a time reallocate rarely; a quarter more once large. Token slots (2): an eighth more
    (at least ``SLOT_ROOM``), since every row gains one a step: a long row joining does not double every row."""
    if dim == 2:
        return needed + max(needed // 8, SLOT_ROOM)
    return needed + min(needed, max(needed // 4, GROWTH)) + 1


def fitted(buffer: torch.Tensor, needs: dict[int, int], shrink: bool = True) -> torch.Tensor:
    """``buffer`` if each dimension ``d`` of ``needs`` holds ``needs[d]`` and, with ``shrink``, not four times that
    (plus ``SLACK``); else one copy in which each dimension that must change is ``roomy`` of its need, the first
    ``needs[d]`` entries kept (zeros after). A copy made to grow also shrinks the dimensions too large."""
    shape = list(buffer.shape)
    grows = any(n > shape[d] for d, n in needs.items())
    for d, n in needs.items():
        if n > shape[d] or ((shrink or grows) and shape[d] > 4 * n + SLACK):
            shape[d] = roomy(n, d)
    if shape == list(buffer.shape):
        return buffer
    out = buffer.new_zeros(shape)
    kept = tuple(slice(0, min(size, needs.get(d, size))) for d, size in enumerate(buffer.shape))
    out[kept] = buffer[kept]
    return out


class PaddedKVLayer(CacheLayerMixin):
    """Full-attention KV of every row, ``[rows, heads, capacity, dim]``, right padded: row r holds its tokens in
    slots ``0..len_r-1`` and writes the new one at ``len_r``. The forward sees ``[:n, :, :longest + 1]``, with a
    mask that hides each row's padding. Capacity grows geometrically and shrinks once four times too large."""

    parts = (StateKind.FULL_ATTENTION,)
    window = 0  # tokens a row keeps (0: all of them)

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.buffers: dict[str, torch.Tensor] = {}  # "keys"/"values": [rows, heads, capacity, dim]
        self.rows, self.width = 0, 0
        self.write_at = torch.zeros(0, dtype=torch.long)

    def fit(self, rows: int, width: int, shrink: bool = False) -> None:
        """Room for ``rows`` rows of ``width`` slots; with ``shrink``, not four times more (``fitted``)."""
        for name, buf in self.buffers.items():
            self.buffers[name] = fitted(buf, {0: rows, 2: width}, shrink)

    def put(self, row: int, states: Sequence[LayerState]) -> None:
        state = states[0]
        for name, t in state.slots:
            if name not in self.buffers:
                shape = (roomy(row + 1), t.shape[1], roomy(state.seq_len, 2), t.shape[3])
                self.buffers[name] = torch.zeros(shape, dtype=t.dtype, device=self.device)
            self.buffers[name][row, :, : state.seq_len].copy_(t[0])

    def move(self, src: int, dst: int, tokens: int) -> None:
        for buf in self.buffers.values():
            buf[dst, :, :tokens].copy_(buf[src, :, :tokens])

    def prepare(self, rows: int, write_at: torch.Tensor, width: int) -> None:
        self.rows, self.write_at, self.width = rows, write_at, width
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

    def lazy_initialization(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("rows are added with put(), not by a forward")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width, 0

    def get_seq_length(self) -> int:
        return self.width - 1

    def get_max_length(self) -> int:
        return -1


class RowLinearLayer(LinearAttentionLayer):
    """Conv and recurrent states of every row, stacked; the model updates the [:n] views in place."""

    parts = (StateKind.LINEAR_ATTENTION,)

    def __init__(self, number_of_states: int, device: torch.device | str) -> None:
        super().__init__(number_of_states=number_of_states)
        self.device = torch.device(device)
        self.linear_buffers: dict[str, torch.Tensor] = {}  # "conv.<i>" / "recurrent.<i>": [rows, ...]

    def fit(self, rows: int, width: int, shrink: bool = False) -> None:
        for name, buf in self.linear_buffers.items():
            self.linear_buffers[name] = fitted(buf, {0: rows}, shrink)

    def put(self, row: int, states: Sequence[LayerState]) -> None:
        for name, t in states[-1].slots:
            if name not in self.linear_buffers:
                shape = (roomy(row + 1), *t.shape[1:])
                self.linear_buffers[name] = torch.zeros(shape, dtype=t.dtype, device=self.device)
            self.linear_buffers[name][row].copy_(t[0])

    def move(self, src: int, dst: int, tokens: int) -> None:
        for buf in self.linear_buffers.values():
            buf[dst].copy_(buf[src])

    def prepare(self, rows: int, write_at: torch.Tensor, width: int) -> None:
        for name, buf in self.linear_buffers.items():
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


RowLayer = PaddedKVLayer | RowLinearLayer | DummyLayer
RowForm = Callable[[CacheLayerMixin, torch.device], RowLayer]  # a cache layer's row form (``family_rows.row_layer``)


class BatchCache:
    """The per-layer row buffers of one decode batch, and the masks of its next step."""

    def __init__(self, config: PreTrainedConfig, row_layer: RowForm, device: torch.device | str = "cpu") -> None:
        self.config, self.device = config, torch.device(device)
        self.layers = [row_layer(t, self.device) for t in DynamicCache(config=config).layers]
        self.mask_of = self._mask_names(config)
        windows = {x.window if isinstance(x, PaddedKVLayer) else 0 for x in self.layers}
        self.one_mask = len(windows) == 1 and all(
            isinstance(x, PaddedKVLayer) and not isinstance(x, RowLinearLayer) for x in self.layers
        )
        self.cache = new_cache(config, self.layers)  # what the model's forward sees
        self.lengths: list[int] = []  # tokens held per row = the position its next token is written at
        self.steps = 0
        self.peak = (0, 0)  # the most rows and the widest step since the buffers last could shrink

    def _mask_names(self, config: PreTrainedConfig) -> dict[str, PaddedKVLayer | None]:
        """Every name a model may look a layer's mask up by -> the layer whose attention the mask is for."""
        out: dict[str, PaddedKVLayer | None] = {}
        for names in (getattr(config, "layer_types", None), getattr(config, "layers_block_type", None)):
            for name, layer in zip(names or (), self.layers):
                out.setdefault(name, layer if isinstance(layer, PaddedKVLayer) else None)
        full = next((x for x in self.layers if isinstance(x, PaddedKVLayer) and not x.window), None)
        ring = next((x for x in self.layers if isinstance(x, PaddedKVLayer) and x.window), None)
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
        self.peak = (max(self.peak[0], n), max(self.peak[1], width))
        self.steps += 1
        shrink = self.steps % SHRINK_EVERY == 0  # to the window's peak: rows that come and go do not churn them
        for layer in self.layers:
            layer.fit(*(self.peak if shrink else (n, width)), shrink=shrink)
            layer.prepare(n, positions, width)
        if shrink:
            self.peak = (0, 0)
        hidden = torch.finfo(dtype).min
        built: dict[int, torch.Tensor] = {}  # one mask per window size (0: full attention)
        masks: dict[str, torch.Tensor | None] = {}
        for name, layer in self.mask_of.items():
            if layer is None:
                masks[name] = None
                continue
            window = layer.window
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
