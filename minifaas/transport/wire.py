"""The KV transport's wire format: fixed-size frame headers, then raw payload bytes.

Every frame is one 148-byte header followed by ``length`` payload bytes. All
integers are little-endian. The format knows tensors, not models: a chunk frame
carries one byte range of one tensor slot of one layer's state. "Layer" is the
state's index in the model's list of states (``state_layout``): a decoder layer
with attention and a Mamba mixer side by side sends two, each of one kind.

    offset size field
       0    4  magic        b"MFKV"
       4    1  version      1
       5    1  frame type   FrameType
       6    1  state kind   StateKind of the layer (chunk frames; else 0)
       7    1  dtype code   state_codec.DTYPES key (chunk frames; else 0)
       8    8  transfer id
      16    4  layer index
      20    2  slot index   position of the slot in the layer's slots
      22    2  slot count   slots in the layer (so the receiver knows when it is whole)
      24    1  ndim         <= 8
      25    1  flags        bit 0: payload not checksummed (checksum field is 0)
      26    2  (zero)
      28    4  checksum of the payload (xxh3-64, low 32 bits)
      32    8  seq_len      tokens the layer state covers
      40    8  byte offset  of this chunk within the slot's bytes
      48    8  length       payload bytes that follow the header
      56   64  shape        8 x u64, unused dims 0
     120   24  slot name    utf-8, NUL padded
     144    4  checksum of header bytes 0..143

Frame types and their payloads:

    START  sender -> receiver   u32 layers, u64 total bytes (0: not known yet)
    CHUNK  sender -> receiver   the slot's bytes [offset, offset + length)
    END    sender -> receiver   u32 layers, u64 total bytes actually sent
    DONE   receiver -> sender   u32 layers, u64 bytes received (on END's connection)
    ABORT  either way           utf-8 reason; the transfer is over

A header is validated completely (magic, version, its own checksum, sizes
against the caller's limits) before any memory is set aside for its payload.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import torch

from minifaas.model.layer_state import StateKind
from minifaas.model.state_codec import DTYPES, checksum
from minifaas.transport.errors import CorruptFrameError, ProtocolError

MAGIC = b"MFKV"
VERSION = 1
MAX_NDIM = 8
NAME_BYTES = 24
MAX_SLOTS = 256
MAX_CONTROL_BYTES = 4096

_HEADER = struct.Struct("<4sBBBBQIHHBB2xIQQQ8Q24s")
UNCHECKED = 1  # flag: the sender skipped the payload checksum (only a receiver that allows it accepts this)
_HEADER_CRC = struct.Struct("<I")
HEADER_SIZE = _HEADER.size + _HEADER_CRC.size
_COUNTS = struct.Struct("<IQ")

_KINDS = frozenset(int(k) for k in StateKind)
_ITEMSIZE = {code: torch.empty((), dtype=dtype).element_size() for code, dtype in DTYPES.items()}


class FrameType(IntEnum):
    START = 1
    CHUNK = 2
    END = 3
    DONE = 4
    ABORT = 5


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
            MAGIC, VERSION, self.type, self.kind, self.dtype, self.transfer, self.layer, self.slot,
            self.n_slots, len(self.shape), self.flags, self.crc, self.seq_len, self.offset, self.length, *shape, name,
        )  # fmt: skip
        return head + _HEADER_CRC.pack(checksum(head))


def unpack_header(buf: bytes | bytearray | memoryview, limits: Limits) -> FrameHeader:
    """Parse and validate one header; raises ProtocolError (or CorruptFrameError) on anything wrong."""
    if len(buf) != HEADER_SIZE:
        raise ProtocolError(f"header must be {HEADER_SIZE} bytes, got {len(buf)}")
    fields = _HEADER.unpack_from(buf, 0)
    magic, version, ftype, kind, dtype, transfer, layer, slot, n_slots, ndim, flags, crc, seq_len, offset, length = (
        fields[:15]
    )
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported wire version {version}")
    if _HEADER_CRC.unpack_from(buf, _HEADER.size)[0] != checksum(memoryview(buf)[: _HEADER.size]):
        raise CorruptFrameError(f"header checksum mismatch (transfer {transfer}, layer {layer})")
    try:
        frame_type = FrameType(ftype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    if ndim > MAX_NDIM:
        raise ProtocolError(f"ndim {ndim} > {MAX_NDIM}")
    header = FrameHeader(
        frame_type, transfer, length, crc, layer, kind, slot, n_slots,
        fields[23].rstrip(b"\0").decode(errors="replace"), dtype, tuple(fields[15 : 15 + ndim]), seq_len, offset, flags,
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
    if h.length > limits.max_chunk_bytes:
        raise ProtocolError(f"chunk claims {h.length} bytes, limit {limits.max_chunk_bytes}")
    if h.slot_bytes > limits.max_slot_bytes:
        raise ProtocolError(f"slot {h.name!r} claims {h.slot_bytes} bytes, limit {limits.max_slot_bytes}")
    if h.offset + h.length > h.slot_bytes:
        raise ProtocolError(f"chunk [{h.offset}, {h.offset + h.length}) outside slot of {h.slot_bytes} bytes")


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
