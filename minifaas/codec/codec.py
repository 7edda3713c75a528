"""KV codecs on the wire: which ``Codec`` each frame gets (``frame_codec``), the per-connection ``FrameEncoder``
and ``FrameDecoder`` that code and decode it, and the lossless coding itself (byte planes).

``lossless`` is bit-exact: the plane of top bytes (sign and high exponent) is zstd-coded, the mantissa bytes
below it go as they are. ``fp8``/``int8`` code only attention KV (``block_scaled``), the rest of a lossy transfer
goes lossless. A coded frame's checksum is that of the decoded bytes, so it covers the codec too, and a sender
uses only the codecs its receiver offered in the handshake. A lossless payload of ``n`` elements of ``w`` bytes:

    u8   form of the top plane: 0 raw, 1 zstd frame; then 3 zero bytes
    u32  bytes of the top plane as sent
         the top plane: n bytes, or a zstd frame that decodes to n bytes
         the other planes, raw: 16-bit floats byte 0 of each element (n bytes); float32 byte 2 of
         each (n bytes), then bytes 1-0 of each as little-endian u16 (2n bytes)
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property

import numpy as np
import torch
import zstandard

from minifaas.codec import block_scaled
from minifaas.codec.block_scaled import BlockError
from minifaas.model.layer_state import DTYPES, StateKind, checksum, tensor_bytes
from minifaas.net.errors import CorruptFrameError

try:  # zstd's experimental settings (``_literal_coder``); the module loads only where cffi is installed
    from zstandard import _cffi
except ImportError:
    _cffi = None

MIN_CODED_BYTES = 4096  # smaller frames go as they are: the prefix and the call cost more than coding saves
# frames this large are coded and decoded in a thread, off the event loop; smaller ones cost less than the hand-off
OFF_LOOP_BYTES = 64 << 10
_LOSSY_KINDS = (StateKind.FULL_ATTENTION, StateKind.SLIDING_WINDOW)

_PREFIX = struct.Struct("<B3xI")
RAW, ZSTD = 0, 1
WIDTHS = (2, 4)  # bytes per element the lossless coding splits (float16, bfloat16, float32)
# the finder's full search, where literal coding cannot be forced on (no cffi)
_ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST,
)  # fmt: skip
ACCELERATION = 64  # positions skipped between match attempts grow by one every this many bytes without a match


class Codec(IntEnum):
    NONE = 0
    LOSSLESS = 1
    FP8 = 2
    INT8 = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def lossy(self) -> bool:
        return self in (Codec.FP8, Codec.INT8)

    @classmethod
    def named(cls, name: str) -> Codec:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown KV codec {name!r}; known: {', '.join(c.label for c in cls)}") from None


ALL_CODECS = frozenset(Codec)


def offer_mask(codecs: frozenset[Codec]) -> int:
    """The handshake's byte: bit i set when codec i decodes here."""
    return sum(1 << c for c in codecs | {Codec.NONE})


def offered(mask: int) -> frozenset[Codec]:
    return frozenset(c for c in Codec if mask >> c & 1) | {Codec.NONE}


def usable(requested: Codec, offer: frozenset[Codec]) -> Codec:
    """What a transfer may use towards a receiver offering ``offer``: a lossy code it lacks becomes lossless."""
    if requested in offer:
        return requested
    return Codec.LOSSLESS if Codec.LOSSLESS in offer else Codec.NONE


def frame_codec(requested: Codec, kind: StateKind, dtype: torch.dtype, nbytes: int) -> Codec:
    """The codec one frame of a slot gets in a transfer that asked for ``requested``."""
    if requested is Codec.NONE or dtype not in block_scaled.FLOATS or nbytes < MIN_CODED_BYTES:
        return Codec.NONE
    if nbytes % dtype.itemsize:
        return Codec.NONE
    if requested.lossy and kind in _LOSSY_KINDS:
        return requested
    return Codec.LOSSLESS


class PlaneError(ValueError):
    """A coded payload that does not decode to the range it claims."""


class PlaneEncoder:
    """One per sending connection: zstd contexts are not shared between threads. ``accelerated`` False
    takes the fallback (the finder's full search) even where the accelerated coder loads."""

    def __init__(self, accelerated: bool = True) -> None:
        coder = _literal_coder() if accelerated else None
        self.accelerated = coder is not None
        self._compress = coder or zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS).compress

    def encode(self, raw: memoryview, width: int) -> list[bytes | memoryview]:
        top, rest = split(raw, width)
        packed = self._compress(top)
        if len(packed) < len(top):
            return [_PREFIX.pack(ZSTD, len(packed)), packed, *rest]
        return [_PREFIX.pack(RAW, len(top)), memoryview(top).cast("B"), *rest]


def _literal_coder() -> Callable[[np.ndarray], memoryview] | None:
    """zstd with literal coding forced on and the finder accelerated, through the zstandard package's
    cffi module; None where that module cannot load."""
    if _cffi is None:
        return None
    ffi, lib = _cffi.ffi, _cffi.lib
    cctx = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
    settings = {
        lib.ZSTD_c_strategy: lib.ZSTD_fast, lib.ZSTD_c_windowLog: 17, lib.ZSTD_c_hashLog: 6,
        lib.ZSTD_c_minMatch: 7, lib.ZSTD_c_targetLength: ACCELERATION,
        lib.ZSTD_c_literalCompressionMode: lib.ZSTD_ps_enable, lib.ZSTD_c_contentSizeFlag: 1,
    }  # fmt: skip
    for key, value in settings.items():
        if lib.ZSTD_isError(lib.ZSTD_CCtx_setParameter(cctx, key, value)):
            return None

    def compress(plane: np.ndarray) -> memoryview:
        out = np.empty(lib.ZSTD_compressBound(plane.size), dtype=np.uint8)
        n = lib.ZSTD_compress2(cctx, ffi.from_buffer(out), out.size, ffi.from_buffer(plane), plane.size)
        if lib.ZSTD_isError(n):
            raise PlaneError(f"zstd: {ffi.string(lib.ZSTD_getErrorName(n)).decode()}")
        return memoryview(out[:n]).cast("B")

    return compress


class PlaneDecoder:
    """One per receiving connection."""

    def __init__(self) -> None:
        self._zstd = zstandard.ZstdDecompressor()

    def decode_into(self, payload: memoryview, width: int, out: memoryview) -> None:
        """Write the ``len(out)`` bytes that ``payload`` codes into ``out``."""
        if width not in WIDTHS or len(out) % width:
            raise PlaneError(f"{len(out)} bytes are not whole elements of {width} bytes")
        n = len(out) // width
        if len(payload) < _PREFIX.size:
            raise PlaneError("payload shorter than its prefix")
        form, top_len = _PREFIX.unpack_from(payload)
        body = _PREFIX.size + top_len
        if form not in (RAW, ZSTD) or len(payload) != body + n * (width - 1):
            raise PlaneError(f"payload of {len(payload)} bytes does not hold {n} elements of {width} bytes")
        top = payload[_PREFIX.size : body]
        if form == ZSTD:
            try:
                top = memoryview(self._zstd.decompress(top, max_output_size=n))
            except zstandard.ZstdError as e:
                raise PlaneError(f"top plane does not decode: {e}") from None
        if len(top) != n:
            raise PlaneError(f"top plane holds {len(top)} bytes, not {n}")
        join(top, payload[body:], width, out)


def split(raw: memoryview, width: int) -> tuple[np.ndarray, list[memoryview]]:
    """The top byte of each element, and the other planes one after another (shifts and narrowing casts,
    much faster than strided copies)."""
    if width not in WIDTHS or len(raw) % width:
        raise PlaneError(f"{len(raw)} bytes are not whole elements of {width} bytes")
    if width == 2:
        words = np.frombuffer(raw, dtype=np.uint16)
        return (words >> 8).astype(np.uint8), [memoryview(words.astype(np.uint8)).cast("B")]
    words32 = np.frombuffer(raw, dtype=np.uint32)
    middle, low = (words32 >> 16).astype(np.uint8), words32.astype(np.uint16)
    return (words32 >> 24).astype(np.uint8), [memoryview(middle).cast("B"), memoryview(low).cast("B")]


def join(top: memoryview, rest: memoryview, width: int, out: memoryview) -> None:
    """The inverse of ``split``, written into ``out``."""
    top_plane = np.frombuffer(top, dtype=np.uint8)
    n = top_plane.size
    if width == 2:
        words = np.frombuffer(out, dtype=np.uint16)
        np.left_shift(top_plane, 8, out=words, dtype=np.uint16)
        words |= np.frombuffer(rest, dtype=np.uint8)
        return
    words32 = np.frombuffer(out, dtype=np.uint32)
    np.left_shift(top_plane, 24, out=words32, dtype=np.uint32)
    words32 |= np.left_shift(np.frombuffer(rest[:n], dtype=np.uint8), 16, dtype=np.uint32)
    words32 |= np.frombuffer(rest[n:], dtype=np.uint16)


@dataclass(frozen=True, slots=True)
class Coded:
    codec: Codec  # what the frame carries: NONE when coding did not pay
    parts: list[memoryview | bytes]
    crc: int  # of the decoded bytes
    nbytes: int  # on the wire


class FrameEncoder:
    """One per sending connection (zstd contexts are not shared between threads). Its ``PlaneEncoder`` is made
    at the first lossless frame, so a transfer with no codec makes no zstd context."""

    def __init__(self, accelerated: bool = True) -> None:
        self._accelerated = accelerated

    @cached_property
    def _planes(self) -> PlaneEncoder:
        return PlaneEncoder(self._accelerated)

    def encode(self, codec: Codec, dtype: torch.dtype, raw: memoryview) -> Coded:
        """``raw`` (whole elements of ``dtype``) coded with ``codec``, or as it is if that would not shrink it."""
        if codec.lossy:
            lossy = block_scaled.encode_blocks(raw, dtype, codec.label)
            if lossy is not None:
                parts, decoded = lossy
                return _smaller(codec, parts, lambda: checksum(tensor_bytes(decoded)), raw)
            codec = Codec.LOSSLESS  # inf or nan in the range: no scale fits it
        if codec is Codec.LOSSLESS:
            return _smaller(codec, self._planes.encode(raw, dtype.itemsize), lambda: checksum(raw), raw)
        return Coded(Codec.NONE, [raw], checksum(raw), len(raw))


def _smaller(codec: Codec, parts: list[memoryview | bytes], crc: Callable[[], int], raw: memoryview) -> Coded:
    nbytes = sum(memoryview(p).nbytes for p in parts)
    if nbytes >= len(raw):
        return Coded(Codec.NONE, [raw], checksum(raw), len(raw))
    return Coded(codec, parts, crc(), nbytes)


class FrameDecoder:
    """One per receiving connection, with the scratch memory its coded payloads are read into."""

    def __init__(self) -> None:
        self._planes = PlaneDecoder()
        self._buffer = bytearray()

    def scratch(self, nbytes: int) -> memoryview:
        """Room for one payload (reused, grown when a larger one comes)."""
        if len(self._buffer) < nbytes:
            self._buffer = bytearray(nbytes)
        return memoryview(self._buffer)[:nbytes]

    def decode_into(self, codec: Codec, dtype_code: int, payload: memoryview, out: memoryview) -> tuple[int, float]:
        """Decode a frame's payload into the slot bytes it stands for; returns their checksum and the
        seconds it took. CorruptFrameError if the payload does not decode to them."""
        start, dtype = time.perf_counter(), DTYPES[dtype_code]
        try:
            if codec is Codec.LOSSLESS:
                self._planes.decode_into(payload, dtype.itemsize, out)
            elif codec.lossy:
                block_scaled.decode_into(payload, dtype, codec.label, out)
            else:
                raise PlaneError(f"{codec.name} is not a coded frame")
        except (PlaneError, BlockError) as e:
            raise CorruptFrameError(f"{codec.label} payload: {e}") from None
        return checksum(out), time.perf_counter() - start


def codecs_for(mode: str) -> frozenset[Codec]:
    """The codecs a worker run with ``--kv-compression mode`` sends with or offers: ``auto`` is none and
    lossless (the scheduler picks per transfer), a lossy mode adds only its own code."""
    if mode == "none":
        return frozenset()
    if mode in ("lossless", "auto"):
        return frozenset({Codec.LOSSLESS})
    return frozenset({Codec.LOSSLESS, Codec.named(mode)})
