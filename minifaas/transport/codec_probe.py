"""A codec measured on a real state: the bytes before and after, and the time to code and decode them.

Chunks are cut, coded, decoded and checked as the sender and the receiver do it, on this thread. A prefill worker
runs it on its warm-up state, so the scheduler has measured codec figures before the first request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minifaas.codec.codec import Codec, Coded, FrameDecoder, FrameEncoder, frame_codec
from minifaas.model.layer_state import DTYPE_CODES, LayerState, ModelState, StateKind
from minifaas.transport.wire import split_chunks


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What coding one state with one codec did, measured at a worker's start; the gateway hands it to the codec
    policy as a ``CodecSample``."""

    codec: str
    nbytes: int  # of state
    wire_bytes: int  # payload bytes the frames would carry
    encode_s: float
    decode_s: float

    @property
    def ratio(self) -> float:
        return self.nbytes / self.wire_bytes if self.wire_bytes else 1.0

    def to_json(self) -> list[float]:
        return [self.nbytes, self.wire_bytes, self.encode_s, self.decode_s]


def probe(state: ModelState, codec: Codec, chunk_bytes: int = 1 << 20) -> ProbeResult:
    """Code and decode every chunk of ``state`` with ``codec``; raises ValueError if a frame comes back wrong."""
    return roundtrip(state, codec, chunk_bytes)[1]


def roundtrip(
    state: ModelState, codec: Codec, chunk_bytes: int = 1 << 20, every_kind: bool = False, accelerated: bool = True
) -> tuple[ModelState, ProbeResult]:
    """``state`` as a receiver would hold it after a transfer coded with ``codec``, and the measurement.
    ``every_kind`` codes linear-attention state with a lossy code too, which no transfer does, to measure
    what that would cost. ``accelerated`` False codes lossless frames with the fallback (``PlaneEncoder``)."""
    encoder, decoder = FrameEncoder(accelerated), FrameDecoder()
    nbytes = wire = 0
    encode_s = decode_s = 0.0
    layers = []
    for layer in state.layers:
        received = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8) for _, t in layer.slots]
        for chunk in split_chunks(layer, chunk_bytes):
            nbytes += chunk.length
            out = memoryview(received[chunk.slot].numpy()).cast("B")[chunk.offset : chunk.offset + chunk.length]
            kind = StateKind.FULL_ATTENTION if every_kind else layer.kind
            frame = frame_codec(codec, kind, chunk.dtype, chunk.length)
            start = time.perf_counter()
            coded = encoder.encode(frame, chunk.dtype, chunk.payload) if frame is not Codec.NONE else None
            encode_s += time.perf_counter() - start
            if coded is None or coded.codec is Codec.NONE:
                wire += chunk.length
                out[:] = chunk.payload
                continue
            wire += coded.nbytes
            crc, seconds = decoder.decode_into(coded.codec, DTYPE_CODES[chunk.dtype], _joined(decoder, coded), out)
            decode_s += seconds
            if crc != coded.crc or (not coded.codec.lossy and out != chunk.payload):
                raise ValueError(f"{coded.codec.label} did not decode layer {layer.layer} back")
        slots = tuple(
            (name, data.view(t.dtype).reshape(t.shape)) for (name, t), data in zip(layer.slots, received, strict=True)
        )
        layers.append(LayerState(layer.layer, layer.kind, layer.seq_len, slots))
    return ModelState(layers, state.seq_len), ProbeResult(codec.label, nbytes, wire, encode_s, decode_s)


def _joined(decoder: FrameDecoder, coded: Coded) -> memoryview:
    """The coded parts in one buffer, as the receiver reads a payload."""
    payload = decoder.scratch(coded.nbytes)
    at = 0
    for part in coded.parts:
        view = memoryview(part).cast("B")
        payload[at : at + view.nbytes] = view
        at += view.nbytes
    return payload
