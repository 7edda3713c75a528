"""Bytes for one LayerState, and back, without copying tensor memory on the way out.

Layout (little-endian), one record per layer state:

    header   "MFLS" magic, u8 version, u8 kind, u16 n_slots, u32 layer, u64 seq_len
    per slot u8 dtype code, u8 ndim, u16 name length, u64 payload bytes,
             u32 checksum of payload, ndim x u64 shape, name (utf-8)
    u32      checksum of everything above (header and slot headers)
    payloads the raw bytes of every slot, in slot order

``encode`` returns the header and one ``memoryview`` per slot on the tensor memory, ready for ``socket.sendmsg``.
``decode`` checks sizes, dtypes and checksums (``layer_state.checksum``) before it builds a tensor, so bad input
raises ``StateCodecError`` and never yields a wrong tensor. ``same_state`` is the bit-exact equality of whole
states that a round trip through bytes keeps.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from minifaas.model.layer_state import DTYPE_CODES, DTYPES, LayerState, ModelState, StateKind, checksum, tensor_bytes

MAGIC = b"MFLS"
VERSION = 1
MAX_NDIM = 8
MAX_SLOT_BYTES = 1 << 40

_HEAD = struct.Struct("<4sBBHIQ")
_SLOT = struct.Struct("<BBHQI")
_CRC = struct.Struct("<I")


class StateCodecError(ValueError):
    """The bytes do not hold a valid layer state."""


def encode(state: LayerState) -> list[bytes | memoryview]:
    payloads = [tensor_bytes(t) for _, t in state.slots]
    parts = [_HEAD.pack(MAGIC, VERSION, int(state.kind), len(state.slots), state.layer, state.seq_len)]
    for (name, t), payload in zip(state.slots, payloads):
        code = DTYPE_CODES.get(t.dtype)
        if code is None:
            raise StateCodecError(f"dtype {t.dtype} has no wire code")
        raw_name = name.encode()
        parts.append(_SLOT.pack(code, t.dim(), len(raw_name), payload.nbytes, checksum(payload)))
        parts.append(struct.pack(f"<{t.dim()}Q", *t.shape) + raw_name)
    header = b"".join(parts)
    return [header + _CRC.pack(checksum(header)), *payloads]


def decode(data: bytes | bytearray | memoryview) -> LayerState:
    view = memoryview(data).cast("B")
    state, used = decode_prefix(view)
    if used != len(view):
        raise StateCodecError(f"{len(view) - used} trailing bytes after the layer state")
    return state


def decode_prefix(view: memoryview) -> tuple[LayerState, int]:
    """Decode one record from the front of ``view``; returns it and the bytes it used."""
    pos = _need(view, 0, _HEAD.size, "header")
    magic, version, kind, n_slots, layer, seq_len = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise StateCodecError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise StateCodecError(f"unsupported version {version}")
    try:
        state_kind = StateKind(kind)
    except ValueError:
        raise StateCodecError(f"unknown state kind {kind}") from None
    specs: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
    for _ in range(n_slots):
        start = pos
        pos = _need(view, pos, _SLOT.size, "slot header")
        code, ndim, name_len, nbytes, crc = _SLOT.unpack_from(view, start)
        dtype = DTYPES.get(code)
        if dtype is None:
            raise StateCodecError(f"unknown dtype code {code}")
        if ndim > MAX_NDIM or nbytes > MAX_SLOT_BYTES:
            raise StateCodecError(f"slot claims ndim={ndim}, {nbytes} bytes: refused")
        start = pos
        pos = _need(view, pos, 8 * ndim + name_len, "slot shape")
        shape = struct.unpack_from(f"<{ndim}Q", view, start)
        name = bytes(view[start + 8 * ndim : pos]).decode(errors="replace")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if _numel(shape) * itemsize != nbytes:
            raise StateCodecError(f"slot {name!r}: shape {shape} does not match {nbytes} bytes")
        specs.append((name, dtype, shape, nbytes, crc))
    start = pos
    pos = _need(view, pos, _CRC.size, "header checksum")
    if _CRC.unpack_from(view, start)[0] != checksum(view[:start]):
        raise StateCodecError(f"header checksum mismatch (layer {layer})")
    slots = []
    for name, dtype, shape, nbytes, crc in specs:
        start = pos
        pos = _need(view, pos, nbytes, f"payload of {name!r}")
        payload = view[start:pos]
        if checksum(payload) != crc:
            raise StateCodecError(f"checksum mismatch in slot {name!r} of layer {layer}")
        slots.append((name, tensor_from_bytes(payload, dtype, shape)))
    try:
        return LayerState(layer, state_kind, seq_len, tuple(slots)), pos
    except ValueError as e:
        raise StateCodecError(str(e)) from None


def tensor_from_bytes(
    payload: memoryview | bytes | bytearray, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """A tensor over a copy of ``payload`` (the copy makes it writable and owned)."""
    if len(payload) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    buf = bytearray(payload)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _need(view: memoryview, pos: int, n: int, what: str) -> int:
    if pos + n > len(view):
        raise StateCodecError(f"truncated: {what} needs {n} bytes at offset {pos}, only {len(view) - pos} left")
    return pos + n


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
