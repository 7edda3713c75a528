"""Per-layer model state: the unit that prefill produces and decode consumes. Three kinds, each in named tensor slots:

- FULL_ATTENTION: ``keys``/``values`` of every token, ``[batch, heads, tokens, dim]``; grows with the prompt
  and can be sliced to a token range (prefix reuse, incremental transfer). MLA keeps its compressed latent here.
- SLIDING_WINDOW: ``keys``/``values`` of the last ``window - 1`` tokens plus the absolute length they end at.
- LINEAR_ATTENTION: ``conv.<i>`` (short-convolution tail) and ``recurrent.<i>`` (linear-attention, Mamba or
  RG-LRU state); a short-convolution layer (LFM2) has only ``conv``. Fixed size, valid at exactly one length.

A layer that keeps two kinds at once (attention beside a Mamba mixer) is two LayerStates, one of each kind.
``state_layout`` reads them out of a transformers ``Cache`` and puts them back; ``state_codec`` makes bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch


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
