"""Bytes for one LayerState, and back, without copying tensor memory on the way out.

Layout (little-endian), one record per layer state:

    header   "MFLS" magic, u8 version, u8 kind, u16 n_slots, u32 layer, u64 seq_len
    per slot u8 dtype code, u8 ndim, u16 name length, u64 payload bytes,
             u32 checksum of payload, ndim x u64 shape, name (utf-8)
    u32      checksum of everything above (header and slot headers)
    payloads the raw bytes of every slot, in slot order

Checksums are the low 32 bits of xxh3-64 (fast: every KV byte is checksummed on both ends). ``encode`` returns
the header as ``bytes`` and one ``memoryview`` per slot on the (contiguous, CPU) tensor memory, ready for
``socket.sendmsg`` or ``writelines``. ``decode`` validates sizes, dtypes and checksums before it builds a tensor,
so corrupt or truncated input raises ``StateCodecError`` and never yields a wrong tensor.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import xxhash

from minifaas.model.layer_state import LayerState, StateKind

MAGIC = b"MFLS"
VERSION = 1
MAX_NDIM = 8
MAX_SLOT_BYTES = 1 << 40

_HEAD = struct.Struct("<4sBBHIQ")
_SLOT = struct.Struct("<BBHQI")
_CRC = struct.Struct("<I")

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


class StateCodecError(ValueError):
    """The bytes do not hold a valid layer state."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a host tensor's memory (copied only if it is not contiguous).

    A device tensor is refused rather than copied here: this runs on event loops, where a ``.cpu()``
    would block the loop until the GPU caught up (``host_copy`` stages states off the loop)."""
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


def encode_bytes(state: LayerState) -> bytes:
    return b"".join(bytes(p) for p in encode(state))


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
