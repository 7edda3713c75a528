"""An incoming transfer: chunks that arrive in any order rebuilt into layer states, handed on in layer order.

``Reassembly`` is the sans-IO part: the receiver asks ``buffer_for(header)`` where a chunk's payload goes (a view
into the slot's final tensor memory, so a payload is received or decoded without a copy), reads it there, then
calls ``commit``, which checks the checksum and returns the layers now deliverable: complete, every layer before
them delivered. ``IncomingTransfer`` is the transfer as its consumer sees it:

    incoming = receiver.transfer(transfer_id)
    async for layer in incoming:      # LayerState 0, 1, 2, ... as soon as each is whole
        ...
    state = await incoming.model_state()   # or: wait for all of them

Iteration ends after the last layer, or raises the ``TransferError`` that ended the transfer; by then the
receiver has dropped the partial state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from minifaas.model.layer_state import DTYPES, LayerState, ModelState, StateKind, checksum
from minifaas.net.channel import Channel
from minifaas.net.errors import CorruptFrameError, ProtocolError, TransferError, TruncatedError
from minifaas.transport.wire import FrameHeader


def _new_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


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
    """The partial state of one incoming transfer, bounded by ``max_bytes``."""

    def __init__(self, transfer: int, max_bytes: int, allocate: Callable[[int], torch.Tensor] = _new_bytes):
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


_END = None


class IncomingTransfer:
    def __init__(self, transfer: int, max_bytes: int, now: float, allocate: Callable[[int], torch.Tensor]):
        self.id = transfer
        self.assembly: Reassembly | None = Reassembly(transfer, max_bytes, allocate)
        self.error: TransferError | None = None
        self.started = False  # a frame has arrived
        self.claimed = False  # a consumer holds this object
        self.last_progress = now
        self.receiving = 0  # chunk payloads being read now: each connection's own deadline watches those
        self.reply_to: Channel | None = None  # where END came from; DONE or ABORT goes back there
        self.received_bytes = 0
        self.wire_bytes = 0  # payload bytes as they came off the network (coded ones smaller)
        self.decode_s = 0.0
        self.complete = False
        self.layers = 0  # delivered so far
        self._queue: asyncio.Queue[LayerState | TransferError | None] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return self.complete or self.error is not None

    def deliver(self, layers: list[LayerState], now: float) -> bool:
        """Hand on layers that are ready; True if this completed the transfer."""
        self.last_progress = now
        for layer in layers:
            self._queue.put_nowait(layer)
        self.layers += len(layers)
        if self.assembly is not None and self.assembly.complete:
            self.received_bytes = self.assembly.received
            self.complete = True
            self.assembly = None  # the layers now belong to the consumer
            self._queue.put_nowait(_END)
            return True
        return False

    def fail(self, error: TransferError) -> bool:
        """End the transfer with ``error``, freeing the partial state. False if it had already ended."""
        if self.finished:
            return False
        self.error = error
        self.assembly = None
        self._queue.put_nowait(error)
        return True

    def discard(self) -> list[LayerState]:
        """Take back the delivered layers no consumer took (the transfer was dropped unclaimed)."""
        items = [self._queue.get_nowait() for _ in range(self._queue.qsize())]
        return [item for item in items if isinstance(item, LayerState)]

    def __aiter__(self) -> AsyncIterator[LayerState]:
        return self._layers()

    async def _layers(self) -> AsyncIterator[LayerState]:
        while True:
            item = await self._queue.get()
            if item is _END:
                self._queue.put_nowait(_END)  # a second iteration ends at once too
                return
            if isinstance(item, TransferError):
                self._queue.put_nowait(item)
                raise item
            yield item

    async def model_state(self) -> ModelState:
        layers = [layer async for layer in self]
        seq_len = max((layer.seq_len for layer in layers), default=0)
        return ModelState(layers, seq_len)
