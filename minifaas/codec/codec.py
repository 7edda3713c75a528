"""KV codecs on the wire: which ``Codec`` each frame gets (``frame_codec``), and the per-connection
``FrameEncoder`` and ``FrameDecoder`` that code and decode it.

``lossless`` is bit-exact (``byte_planes``); ``fp8``/``int8`` code only attention KV (``block_scaled``), the
rest of a lossy transfer goes lossless. A coded frame's checksum is that of the decoded bytes, so it covers the
codec too, and a sender uses only the codecs its receiver offered in the handshake.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import torch

from minifaas.codec import block_scaled
from minifaas.codec.block_scaled import BlockError
from minifaas.codec.byte_planes import PlaneDecoder, PlaneEncoder, PlaneError
from minifaas.model.layer_state import DTYPES, StateKind, checksum
from minifaas.net.errors import CorruptFrameError

MIN_CODED_BYTES = 4096  # smaller frames go as they are: the prefix and the call cost more than coding saves
# frames this large are coded and decoded in a thread, off the event loop; smaller ones cost less than the hand-off
OFF_LOOP_BYTES = 64 << 10
_LOSSY_KINDS = (StateKind.FULL_ATTENTION, StateKind.SLIDING_WINDOW)


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
        self._plane_encoder: PlaneEncoder | None = None

    @property
    def _planes(self) -> PlaneEncoder:
        if self._plane_encoder is None:
            self._plane_encoder = PlaneEncoder(self._accelerated)
        return self._plane_encoder

    def encode(self, codec: Codec, dtype: torch.dtype, raw: memoryview) -> Coded:
        """``raw`` (whole elements of ``dtype``) coded with ``codec``, or as it is if that would not shrink it."""
        if codec.lossy:
            lossy = block_scaled.encode_blocks(raw, dtype, codec.label)
            if lossy is not None:
                parts, decoded = lossy
                return _smaller(codec, parts, lambda: checksum(_bytes(decoded)), raw)
            codec = Codec.LOSSLESS  # inf or nan in the range: no scale fits it
        if codec is Codec.LOSSLESS:
            return _smaller(codec, self._planes.encode(raw, raw_width(dtype)), lambda: checksum(raw), raw)
        return Coded(Codec.NONE, [raw], checksum(raw), len(raw))


def _smaller(codec: Codec, parts: list[memoryview | bytes], crc: Callable[[], int], raw: memoryview) -> Coded:
    nbytes = sum(memoryview(p).nbytes for p in parts)
    if nbytes >= len(raw):
        return Coded(Codec.NONE, [raw], checksum(raw), len(raw))
    return Coded(codec, parts, crc(), nbytes)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


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
        start = time.perf_counter()
        self._decode(codec, DTYPES[dtype_code], payload, out)
        return checksum(out), time.perf_counter() - start

    def _decode(self, codec: Codec, dtype: torch.dtype, payload: memoryview, out: memoryview) -> None:
        try:
            if codec is Codec.LOSSLESS:
                self._planes.decode_into(payload, raw_width(dtype), out)
            elif codec.lossy:
                block_scaled.decode_into(payload, dtype, codec.label, out)
            else:
                raise PlaneError(f"{codec.name} is not a coded frame")
        except (PlaneError, BlockError) as e:
            raise CorruptFrameError(f"{codec.label} payload: {e}") from None


def raw_width(dtype: torch.dtype) -> int:
    return dtype.itemsize


def codecs_for(mode: str) -> frozenset[Codec]:
    """The codecs a worker run with ``--kv-compression mode`` sends with or offers: ``auto`` is none and
    lossless (the scheduler picks per transfer), a lossy mode adds only its own code."""
    if mode == "none":
        return frozenset()
    if mode in ("lossless", "auto"):
        return frozenset({Codec.LOSSLESS})
    return frozenset({Codec.LOSSLESS, Codec.named(mode)})
