"""The KV transport's wire format: a fixed-size header (laid out above ``_HEADER``, little-endian), then ``length``
payload bytes; layer states cut into CHUNK frames, and ``Reassembly`` putting them back. Frames and payloads:

    START  sender -> receiver   u32 layers, u64 total bytes (0: not known yet)
    CHUNK  sender -> receiver   the slot's bytes [offset, offset + decoded), coded by ``codec``
    END    sender -> receiver   u32 layers, u64 total bytes actually sent (decoded)
    DONE   receiver -> sender   u32 layers, u64 bytes received (decoded), u64 bytes on the wire,
                                u64 nanoseconds spent decoding (on END's connection)
    ABORT  either way           utf-8 reason; the transfer is over
    ALIVE  sender -> receiver   empty: the sender lives while its producer has no new layer yet

A CHUNK carries one byte range of one tensor slot of one layer at the offset it takes in the finished slot, so the
receiver writes its payload straight into that slot's memory and rebuilds a layer sent in pieces, in any order,
without knowing it was cut. A header is checked whole (magic, version, its own checksum, sizes against ``Limits``)
before its payload gets memory.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import IntEnum

import torch

from minifaas.codec.codec import Codec, Coded
from minifaas.model.host_copy import CopyDone
from minifaas.model.layer_state import DTYPE_CODES, DTYPES, LayerState, StateKind, checksum, tensor_bytes
from minifaas.net.errors import CorruptFrameError, ProtocolError, TruncatedError

MAGIC = b"MFKV"
VERSION = 3
MAX_NDIM = 8
NAME_BYTES = 24
MAX_SLOTS = 256
MAX_CONTROL_BYTES = 4096

# The header. offset size field
#    0    4  magic        b"MFKV"
#    4    1  version      3
#    5    1  frame type   FrameType
#    6    1  state kind   StateKind of the layer (chunk frames; else 0)
#    7    1  dtype code   layer_state.DTYPES key (chunk frames; else 0)
#    8    8  transfer id
#   16    4  layer index
#   20    2  slot index   position of the slot in the layer's slots
#   22    2  slot count   slots in the layer (so the receiver knows when it is whole)
#   24    1  ndim         <= 8
#   25    1  flags        bit 0 (UNCHECKED): payload not checksummed, checksum field 0
#   26    1  codec        codec.Codec of the payload (0: the slot's bytes as they are)
#   27    1  (zero)
#   28    4  checksum of the decoded payload (xxh3-64, low 32 bits)
#   32    8  seq_len      tokens the layer state covers
#   40    8  byte offset  of this chunk within the slot's bytes
#   48    8  length       payload bytes that follow the header
#   56    8  decoded      slot bytes the payload decodes to (= length when the codec is 0)
#   64   64  shape        8 x u64, unused dims 0
#  128   24  slot name    utf-8, NUL padded
#  152    4  checksum of header bytes 0..151 (_HEADER_CRC)
_HEADER = struct.Struct("<4sBBBBQIHHBBBxIQQQQ8Q24s")
UNCHECKED = 1  # flag: the sender skipped the payload checksum (only a receiver that allows it accepts this)
_HEADER_CRC = struct.Struct("<I")
HEADER_SIZE = _HEADER.size + _HEADER_CRC.size
_COUNTS = struct.Struct("<IQ")
_RECEIPT = struct.Struct("<IQQQ")

_KINDS = frozenset(int(k) for k in StateKind)
_ITEMSIZE = {code: torch.empty((), dtype=dtype).element_size() for code, dtype in DTYPES.items()}


class FrameType(IntEnum):
    START = 1
    CHUNK = 2
    END = 3
    DONE = 4
    ABORT = 5
    ALIVE = 6


@dataclass(frozen=True, slots=True)
class Limits:
    """What a receiver is willing to accept from one header."""

    max_chunk_bytes: int = 64 << 20
    max_slot_bytes: int = 16 << 30

    def __post_init__(self) -> None:
        if self.max_chunk_bytes <= 0 or self.max_slot_bytes <= 0:
            raise ValueError("limits must be positive")


@dataclass(frozen=True, slots=True)
class FrameHeader:
    type: FrameType
    transfer: int
    length: int = 0
    crc: int = 0
    layer: int = 0
    kind: int = 0
    slot: int = 0
    n_slots: int = 0
    name: str = ""
    dtype: int = 0
    shape: tuple[int, ...] = ()
    seq_len: int = 0
    offset: int = 0
    flags: int = 0
    codec: int = 0
    decoded: int = -1  # slot bytes the payload stands for; left out (-1): ``length``, an uncoded payload

    def __post_init__(self) -> None:
        if self.decoded < 0:
            object.__setattr__(self, "decoded", self.length)

    @property
    def slot_bytes(self) -> int:
        """Size of the whole slot this chunk belongs to."""
        n = _ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def pack(self) -> bytes:
        shape = (*self.shape, *([0] * (MAX_NDIM - len(self.shape))))  # name and shape fit: ``split_chunks`` checked
        head = _HEADER.pack(
            MAGIC, VERSION, self.type, self.kind, self.dtype, self.transfer, self.layer, self.slot, self.n_slots,
            len(self.shape), self.flags, self.codec, self.crc, self.seq_len, self.offset, self.length, self.decoded,
            *shape, self.name.encode(),
        )  # fmt: skip
        return head + _HEADER_CRC.pack(checksum(head))


def unpack_header(buf: bytes | bytearray | memoryview, limits: Limits) -> FrameHeader:
    """Parse and validate one header; raises ProtocolError (or CorruptFrameError) on anything wrong."""
    if len(buf) != HEADER_SIZE:
        raise ProtocolError(f"header must be {HEADER_SIZE} bytes, got {len(buf)}")
    fields = _HEADER.unpack_from(buf, 0)
    magic, version, ftype, kind, dtype, transfer, layer, slot, n_slots, ndim, flags, codec = fields[:12]
    crc, seq_len, offset, length, decoded = fields[12:17]
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"wire version {version} frame; this end speaks version {VERSION}")
    if _HEADER_CRC.unpack_from(buf, _HEADER.size)[0] != checksum(memoryview(buf)[: _HEADER.size]):
        raise CorruptFrameError(f"header checksum mismatch (transfer {transfer}, layer {layer})")
    try:
        frame_type = FrameType(ftype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    if ndim > MAX_NDIM:
        raise ProtocolError(f"ndim {ndim} > {MAX_NDIM}")
    name = fields[25].rstrip(b"\0").decode(errors="replace")
    header = FrameHeader(
        frame_type, transfer, length, crc, layer, kind, slot, n_slots, name, dtype, tuple(fields[17 : 17 + ndim]),
        seq_len, offset, flags, codec, decoded,
    )  # fmt: skip
    if frame_type is FrameType.CHUNK:
        _check_chunk(header, limits)
    elif length > MAX_CONTROL_BYTES:
        raise ProtocolError(f"{frame_type.name} frame claims {length} payload bytes")
    return header


def _check_chunk(h: FrameHeader, limits: Limits) -> None:
    if h.kind not in _KINDS:
        raise ProtocolError(f"unknown state kind {h.kind}")
    if h.dtype not in DTYPES:
        raise ProtocolError(f"unknown dtype code {h.dtype}")
    if not 0 <= h.slot < h.n_slots <= MAX_SLOTS:
        raise ProtocolError(f"slot {h.slot} of {h.n_slots} (at most {MAX_SLOTS})")
    if h.codec >= len(Codec):
        raise ProtocolError(f"unknown codec {h.codec}")
    if h.codec == 0 and h.decoded != h.length:
        raise ProtocolError(f"an uncoded chunk of {h.length} bytes claims to decode to {h.decoded}")
    if max(h.length, h.decoded) > limits.max_chunk_bytes:
        raise ProtocolError(f"chunk claims {max(h.length, h.decoded)} bytes, limit {limits.max_chunk_bytes}")
    if h.slot_bytes > limits.max_slot_bytes:
        raise ProtocolError(f"slot {h.name!r} claims {h.slot_bytes} bytes, limit {limits.max_slot_bytes}")
    if h.offset + h.decoded > h.slot_bytes:
        raise ProtocolError(f"chunk [{h.offset}, {h.offset + h.decoded}) outside slot of {h.slot_bytes} bytes")


def control(ftype: FrameType, transfer: int, payload: bytes = b"") -> bytes:
    """A whole control frame (header and payload) as bytes."""
    return FrameHeader(ftype, transfer, len(payload), checksum(payload)).pack() + payload


def pack_counts(layers: int, nbytes: int) -> bytes:
    return _COUNTS.pack(layers, nbytes)


def unpack_counts(payload: bytes | bytearray | memoryview) -> tuple[int, int]:
    if len(payload) != _COUNTS.size:
        raise ProtocolError(f"counts payload must be {_COUNTS.size} bytes, got {len(payload)}")
    return _COUNTS.unpack(payload)


@dataclass(frozen=True, slots=True)
class Receipt:
    """DONE's payload: what the receiver took in, and what decoding it cost there."""

    layers: int
    nbytes: int  # decoded
    wire_bytes: int
    decode_s: float

    def pack(self) -> bytes:
        return _RECEIPT.pack(self.layers, self.nbytes, self.wire_bytes, round(self.decode_s * 1e9))

    @classmethod
    def unpack(cls, payload: bytes | bytearray | memoryview) -> Receipt:
        if len(payload) != _RECEIPT.size:
            raise ProtocolError(f"DONE payload must be {_RECEIPT.size} bytes, got {len(payload)}")
        layers, nbytes, wire_bytes, nanoseconds = _RECEIPT.unpack(payload)
        return cls(layers, nbytes, wire_bytes, nanoseconds / 1e9)


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
        """The same bytes as consecutive chunks of at most ``piece_bytes`` (an empty chunk: itself)."""
        return [
            replace(self, source=self.source + at, offset=self.offset + at, length=min(piece_bytes, self.length - at))
            for at in range(0, max(self.length, 1), piece_bytes)
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


def split_chunks(state: LayerState, chunk_bytes: int, ready: CopyDone | None = None) -> list[Chunk]:
    """Chunks covering every slot of ``state`` (an empty slot still gets one, empty, chunk); ``ready``: the
    copy that fills the host tensors, if it is still under way."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    chunks: list[Chunk] = []
    for index, (name, tensor) in enumerate(state.slots):
        _wire_ready(name, tensor.dtype, tensor.dim())
        data = tensor_bytes(tensor)  # a view of tensor memory, no copy
        whole = Chunk(state, index, data, 0, 0, data.nbytes, tuple(tensor.shape), state.seq_len, ready)
        chunks += whole.pieces(chunk_bytes)
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
    chunks: list[Chunk] = []
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
            run_chunk = Chunk(piece, index, data, source, offset, piece.seq_len * row, shape, total, ready)
            chunks += run_chunk.pieces(chunk_bytes)
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


@dataclass(slots=True)
class _Slot:
    name: str
    dtype: int
    shape: tuple[int, ...]
    data: torch.Tensor  # uint8, the slot's bytes
    view: memoryview  # of ``data``: chunks are received into slices of it
    chunks: dict[int, int] = field(default_factory=dict)  # offset -> length
    received: int = 0

    @property
    def complete(self) -> bool:
        return self.received == self.data.numel()

    def check_tiling(self) -> None:
        end = 0
        for offset in sorted(self.chunks):
            if offset != end:
                raise ProtocolError(f"slot {self.name!r}: chunks leave a gap or overlap at byte {offset}")
            end += self.chunks[offset]

    def tensor(self) -> torch.Tensor:
        return self.data.view(DTYPES[self.dtype]).reshape(self.shape)


@dataclass(slots=True)
class _Layer:
    kind: int
    seq_len: int
    n_slots: int
    slots: dict[int, _Slot] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.slots) == self.n_slots and all(s.complete for s in self.slots.values())


class Reassembly:
    """The partial state of one incoming transfer, bounded by ``max_bytes``: where each chunk's payload goes (a view
    into its slot's memory, from ``allocate``), and which layers a checked chunk makes whole, in layer order."""

    def __init__(self, transfer: int, max_bytes: int, allocate: Callable[[int], torch.Tensor]):
        self.transfer = transfer
        self._allocate = allocate
        self.max_bytes = max_bytes
        self.expected_layers: int | None = None
        self.expected_bytes: int | None = None
        self.allocated = 0
        self.received = 0
        self.delivered = 0  # layers 0 .. delivered-1 have been handed out
        self.pending = 0  # chunks given a buffer but not yet committed
        self._layers: dict[int, _Layer] = {}

    @property
    def complete(self) -> bool:
        return self.expected_bytes is not None and self.delivered == self.expected_layers

    def start(self, layers: int, total_bytes: int) -> None:
        if total_bytes > self.max_bytes:
            raise ProtocolError(f"transfer {self.transfer} announces {total_bytes} bytes, limit {self.max_bytes}")
        self._expect_layers(layers)

    def end(self, layers: int, total_bytes: int) -> None:
        """The sender has sent everything; what is not here now will not come."""
        self._expect_layers(layers)
        self.expected_bytes = total_bytes
        self._check_totals()

    def _check_totals(self) -> None:
        if self.expected_bytes is None:
            return
        if self.received > self.expected_bytes:
            raise ProtocolError(f"transfer {self.transfer}: {self.received} bytes, sender sent {self.expected_bytes}")
        if self.received == self.expected_bytes and not self.pending and not self.complete:
            raise TruncatedError(f"transfer {self.transfer}: all {self.received} bytes arrived but layers are missing")

    def _expect_layers(self, layers: int) -> None:
        if self.expected_layers not in (None, layers):
            raise ProtocolError(f"transfer {self.transfer}: {layers} layers announced, {self.expected_layers} before")
        if any(i >= layers for i in self._layers):
            raise ProtocolError(f"transfer {self.transfer}: a layer index is beyond {layers} layers")
        self.expected_layers = layers

    def buffer_for(self, h: FrameHeader) -> memoryview:
        if h.layer < self.delivered or (self.expected_layers is not None and h.layer >= self.expected_layers):
            raise ProtocolError(f"transfer {self.transfer}: unexpected chunk for layer {h.layer}")
        layer = self._layers.get(h.layer)
        if layer is None:
            layer = self._layers[h.layer] = _Layer(h.kind, h.seq_len, h.n_slots)
        elif (layer.kind, layer.seq_len, layer.n_slots) != (h.kind, h.seq_len, h.n_slots):
            raise ProtocolError(f"transfer {self.transfer}: chunks of layer {h.layer} disagree on its shape")
        slot = layer.slots.get(h.slot)
        if slot is None:
            if self.allocated + h.slot_bytes > self.max_bytes:
                raise ProtocolError(f"transfer {self.transfer} exceeds its limit of {self.max_bytes} bytes")
            self.allocated += h.slot_bytes
            data = self._allocate(h.slot_bytes)
            view = memoryview(data.numpy()).cast("B") if h.slot_bytes else memoryview(b"")
            slot = layer.slots[h.slot] = _Slot(h.name, h.dtype, h.shape, data, view)
        elif (slot.name, slot.dtype, slot.shape) != (h.name, h.dtype, h.shape):
            raise ProtocolError(f"transfer {self.transfer}: chunks of slot {h.name!r} disagree on dtype or shape")
        if h.offset in slot.chunks:
            raise ProtocolError(f"transfer {self.transfer}: duplicate chunk at byte {h.offset} of {h.name!r}")
        self.pending += 1
        return slot.view[h.offset : h.offset + h.decoded]

    def commit(self, h: FrameHeader, payload: memoryview, crc: int | None = None) -> list[LayerState]:
        """Accept a received chunk; ``crc`` is its checksum if the caller computed it already."""
        self.pending -= 1
        if (checksum(payload) if crc is None else crc) != h.crc:
            raise CorruptFrameError(f"transfer {self.transfer}: payload checksum mismatch in layer {h.layer}")
        slot = self._layers[h.layer].slots[h.slot]
        slot.chunks[h.offset] = h.decoded
        slot.received += h.decoded
        self.received += h.decoded
        if slot.received > slot.data.numel():
            raise ProtocolError(f"slot {slot.name!r} received more bytes than it holds")
        if slot.complete:
            slot.check_tiling()
        ready = self._ready()
        self._check_totals()
        return ready

    def _ready(self) -> list[LayerState]:
        out = []
        while (layer := self._layers.get(self.delivered)) is not None and layer.complete:
            slots = tuple((s.name, s.tensor()) for _, s in sorted(layer.slots.items()))
            out.append(LayerState(self.delivered, StateKind(layer.kind), layer.seq_len, slots))
            del self._layers[self.delivered]
            self.delivered += 1
        return out
