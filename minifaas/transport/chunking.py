"""Cutting layer states into chunks: byte ranges of tensor slots, each sent as one CHUNK frame.

A token range of a full-attention layer is cut into the byte ranges it will occupy in the finished slot, so the
receiver assembles the whole layer without knowing it came in pieces. Payloads are views of tensor memory: nothing
is copied until the kernel, or a codec, reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minifaas.codec.codec import Codec, Coded
from minifaas.model.host_copy import CopyDone
from minifaas.model.layer_state import DTYPE_CODES, LayerState, StateKind, checksum, tensor_bytes
from minifaas.transport.wire import MAX_NDIM, NAME_BYTES, UNCHECKED, FrameHeader, FrameType

Payload = bytes | memoryview


@dataclass(frozen=True, slots=True)
class Chunk:
    """``length`` bytes of one slot: read at ``source`` in ``data``, written at ``offset`` in the finished slot."""

    state: LayerState  # the state (or token range of one) the bytes come from
    slot: int
    data: memoryview  # that slot's bytes in ``state``
    source: int
    offset: int
    length: int
    shape: tuple[int, ...]  # of the finished slot
    seq_len: int  # of the finished layer
    ready: CopyDone | None = None  # the device-to-host copy of ``data`` to wait for before reading it (None: ready)

    @property
    def payload(self) -> memoryview:
        return self.data[self.source : self.source + self.length]

    @property
    def dtype(self) -> torch.dtype:
        return self.state.slots[self.slot][1].dtype

    def pieces(self, piece_bytes: int) -> list[Chunk]:
        """The same bytes as consecutive chunks of at most ``piece_bytes``."""
        return [
            replace(self, source=self.source + at, offset=self.offset + at, length=min(piece_bytes, self.length - at))
            for at in range(0, self.length, piece_bytes)
        ]

    def frame(self, transfer: int, checked: bool = True) -> tuple[bytes, memoryview]:
        """Header and payload; the checksum is computed here, when the chunk is about to be sent."""
        payload = self.payload
        return self._header(transfer, payload.nbytes, checksum(payload) if checked else None, Codec.NONE), payload

    def coded_frame(self, transfer: int, coded: Coded) -> tuple[bytes, list[Payload]]:
        """Header and payload parts of the chunk as ``coded`` (checksummed always: so is the decoder)."""
        return self._header(transfer, coded.nbytes, coded.crc, coded.codec), coded.parts

    def _header(self, transfer: int, length: int, crc: int | None, codec: Codec) -> bytes:
        name, tensor = self.state.slots[self.slot]
        header = FrameHeader(
            FrameType.CHUNK, transfer, length, crc or 0, self.state.layer, int(self.state.kind), self.slot,
            len(self.state.slots), name, DTYPE_CODES[tensor.dtype], self.shape, self.seq_len, self.offset,
            UNCHECKED if crc is None else 0, int(codec), self.length,
        )  # fmt: skip
        return header.pack()


def _wire_ready(name: str, dtype: object, ndim: int) -> None:
    if dtype not in DTYPE_CODES or len(name.encode()) > NAME_BYTES or ndim > MAX_NDIM:
        raise ValueError(f"slot {name!r} ({dtype}, {ndim} dims) cannot go on the wire")


def _ranges(start: int, length: int, chunk_bytes: int) -> range:
    return range(start, start + max(length, 1), chunk_bytes)


def split_chunks(state: LayerState, chunk_bytes: int, ready: CopyDone | None = None) -> list[Chunk]:
    """Chunks covering every slot of ``state`` (an empty slot still gets one, empty, chunk); ``ready``: the
    copy that fills the host tensors, if it is still under way."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    chunks = []
    for index, (name, tensor) in enumerate(state.slots):
        _wire_ready(name, tensor.dtype, tensor.dim())
        data = tensor_bytes(tensor)  # a view of tensor memory, no copy
        shape = tuple(tensor.shape)
        for at in _ranges(0, data.nbytes, chunk_bytes):
            length = min(chunk_bytes, data.nbytes - at)
            chunks.append(Chunk(state, index, data, at, at, length, shape, state.seq_len, ready))
    return chunks


def split_token_range(
    piece: LayerState, start: int, total: int, chunk_bytes: int, ready: CopyDone | None = None
) -> list[Chunk]:
    """Chunks that put ``piece`` (tokens [start, start + piece.seq_len) of a full-attention layer)
    where those tokens sit in the finished layer of ``total`` tokens. Slots are ``[..., tokens, dim]``: each
    leading index (batch, head) holds one run of the piece's rows, which lands at row ``start`` of that index."""
    if piece.kind is not StateKind.FULL_ATTENTION:
        raise ValueError(f"only full-attention state grows by tokens, not {piece.kind.name}")
    if chunk_bytes <= 0 or not 0 <= start <= start + piece.seq_len <= total:
        raise ValueError(f"tokens [{start}, {start + piece.seq_len}) do not fit in {total}")
    chunks = []
    for index, (name, tensor) in enumerate(piece.slots):
        _wire_ready(name, tensor.dtype, tensor.dim())
        if tensor.dim() < 2 or tensor.shape[-2] != piece.seq_len:
            raise ValueError(f"slot {name!r} of shape {tuple(tensor.shape)} is not [..., {piece.seq_len}, dim]")
        data = tensor_bytes(tensor)
        row = tensor.shape[-1] * tensor.element_size()  # bytes of one token in one (batch, head)
        shape = (*tensor.shape[:-2], total, tensor.shape[-1])
        runs = tensor.numel() // max(piece.seq_len * tensor.shape[-1], 1) if piece.seq_len else 0
        for run in range(runs):
            source, offset = run * piece.seq_len * row, (run * total + start) * row
            for at in _ranges(0, piece.seq_len * row, chunk_bytes):
                length = min(chunk_bytes, piece.seq_len * row - at)
                chunks.append(Chunk(piece, index, data, source + at, offset + at, length, shape, total, ready))
    return chunks


def cut_tail(chunks: list[Chunk], connections: int, piece_bytes: int | None) -> list[Chunk]:
    """The chunks with the last ``connections`` chunks' worth of bytes cut into pieces of ``piece_bytes``, so
    that the connections end together instead of a few carrying a whole last chunk each while the rest idle."""
    if piece_bytes is None or connections == 1 or not chunks:
        return chunks
    budget, cut = connections * max(c.length for c in chunks), []
    for chunk in reversed(chunks):
        if budget <= 0 or chunk.length <= piece_bytes:
            cut.append(chunk)
        else:
            cut.extend(reversed(chunk.pieces(piece_bytes)))
        budget -= chunk.length
    cut.reverse()
    return cut
