"""Per-layer model state (``LayerState``): the unit that prefill produces and decode consumes, in named tensor slots.

- FULL_ATTENTION: ``keys``/``values`` of every token, ``[batch, heads, tokens, dim]`` (MLA keeps its latent
  here); can be sliced to a token range.
- SLIDING_WINDOW: ``keys``/``values`` of the last ``window - 1`` tokens, and the length they end at.
- LINEAR_ATTENTION: ``conv.<i>`` and ``recurrent.<i>`` (linear attention, Mamba or RG-LRU); fixed size, valid at
  exactly one length.

A slot's bytes go on the wire as they are (``tensor_bytes``), with a one-byte dtype code and a ``checksum``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch
import xxhash


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


@dataclass(slots=True)
class ModelState:
    """All layers of one request's state, at ``seq_len`` tokens."""

    layers: list[LayerState]
    seq_len: int
    extras: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)


def same_state(a: ModelState, b: ModelState) -> bool:
    """Bit-exact equality: same layers, kinds, lengths, slot names, dtypes, shapes and bytes."""
    if len(a.layers) != len(b.layers):
        return False
    for la, lb in zip(a.layers, b.layers, strict=True):
        if (la.layer, la.kind, la.seq_len, len(la.slots)) != (lb.layer, lb.kind, lb.seq_len, len(lb.slots)):
            return False
        for (na, ta), (nb, tb) in zip(la.slots, lb.slots, strict=True):
            if na != nb or ta.dtype != tb.dtype or ta.shape != tb.shape:
                return False
            if not torch.equal(ta.contiguous().view(torch.uint8), tb.contiguous().view(torch.uint8)):
                return False
    return True


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
