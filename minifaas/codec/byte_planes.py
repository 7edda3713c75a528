"""Lossless coding of float tensors: the plane of top bytes (sign and high exponent) is zstd-coded, the
mantissa bytes below it go as they are.

Payload of a coded range of ``n`` elements of ``w`` bytes:

    u8   form of the top plane: 0 raw, 1 zstd frame; then 3 zero bytes
    u32  bytes of the top plane as sent
         the top plane: n bytes, or a zstd frame that decodes to n bytes
         the other planes, raw: 16-bit floats byte 0 of each element (n bytes); float32 byte 2 of
         each (n bytes), then bytes 1-0 of each as little-endian u16 (2n bytes)
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import zstandard

try:  # zstd's experimental settings (``_literal_coder``); the module loads only where cffi is installed
    from zstandard import _cffi
except ImportError:
    _cffi = None

_PREFIX = struct.Struct("<B3xI")
RAW, ZSTD = 0, 1
WIDTHS = (2, 4)  # bytes per element this codec splits (float16, bfloat16, float32)
# the finder's full search, where literal coding cannot be forced on (no cffi)
_ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST,
)  # fmt: skip
ACCELERATION = 64  # positions skipped between match attempts grow by one every this many bytes without a match


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
        return (words >> 8).astype(np.uint8), [_bytes(words.astype(np.uint8))]
    words32 = np.frombuffer(raw, dtype=np.uint32)
    middle, low = (words32 >> 16).astype(np.uint8), words32.astype(np.uint16)
    return (words32 >> 24).astype(np.uint8), [_bytes(middle), _bytes(low)]


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(a).cast("B")


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
