"""The KV transport's wire format: a fixed-size header (laid out above ``_HEADER``), then ``length`` payload bytes.

Integers are little-endian. A CHUNK frame carries one byte range of one tensor slot of one layer's state, "layer"
being the state's index in the model's list of states (``layer_state.StateLayout``). Frame types and their payloads:

    START  sender -> receiver   u32 layers, u64 total bytes (0: not known yet)
    CHUNK  sender -> receiver   the slot's bytes [offset, offset + decoded), coded by ``codec``
    END    sender -> receiver   u32 layers, u64 total bytes actually sent (decoded)
    DONE   receiver -> sender   u32 layers, u64 bytes received (decoded), u64 bytes on the wire,
                                u64 nanoseconds spent decoding (on END's connection)
    ABORT  either way           utf-8 reason; the transfer is over
    ALIVE  sender -> receiver   empty: the sender lives while its producer has no new layer yet

A header is checked whole (magic, version, its own checksum, sizes against ``Limits``) before its payload gets memory.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import torch

from minifaas.model.layer_state import DTYPES, StateKind, checksum
from minifaas.net.errors import CorruptFrameError, ProtocolError

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
CODECS = 4  # codec ids 0..3 (codec.Codec)

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
        name = self.name.encode()
        if len(name) > NAME_BYTES:
            raise ValueError(f"slot name {self.name!r} longer than {NAME_BYTES} bytes")
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"{len(self.shape)} dims; the wire carries at most {MAX_NDIM}")
        shape = (*self.shape, *([0] * (MAX_NDIM - len(self.shape))))
        head = _HEADER.pack(
            MAGIC, VERSION, self.type, self.kind, self.dtype, self.transfer, self.layer, self.slot, self.n_slots,
            len(self.shape), self.flags, self.codec, self.crc, self.seq_len, self.offset, self.length, self.decoded,
            *shape, name,
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
    if h.codec >= CODECS:
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
    layers, nbytes = _COUNTS.unpack(payload)
    return layers, nbytes


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
