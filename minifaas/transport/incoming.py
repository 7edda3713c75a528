"""An incoming transfer: chunks that arrive in any order rebuilt into layer states, handed on in layer order.

``Reassembly`` is the sans-IO part: where a chunk's payload goes (a view into the slot's final tensor, no copy)
and which layers a checked chunk makes deliverable. ``IncomingTransfer`` is what a consumer iterates, each layer
as soon as it is whole, until the last or the ``TransferError`` that ended it. ``TransferTable`` holds a
receiver's transfers by id (frames may come before the consumer asks) and drops the ones nobody claims.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from minifaas.model.layer_state import DTYPES, LayerState, ModelState, StateKind, checksum
from minifaas.net.channel import Channel
from minifaas.net.errors import CorruptFrameError, DroppedError, ProtocolError, TransferError, TruncatedError
from minifaas.transport.wire import FrameHeader

FORGET_AFTER = 4096  # ended transfer ids remembered, so late frames are skipped, not restarted
OnDrop = Callable[["IncomingTransfer", str], None]


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
        self.abandoned = False  # its consumer stopped waiting (the request was aborted): a failure now is expected
        self.layers = 0  # delivered so far
        self._queue: asyncio.Queue[LayerState | TransferError | None] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return self.complete or self.error is not None

    def abandon(self) -> None:
        self.abandoned = True

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


class TransferTable:
    def __init__(
        self,
        max_open: int,
        max_transfer_bytes: int,
        allocate: Callable[[int], torch.Tensor],
        grace: float = 10.0,
        on_drop: OnDrop | None = None,
    ) -> None:
        self.max_open, self.max_transfer_bytes, self._allocate = max_open, max_transfer_bytes, allocate
        self.grace, self._on_drop = grace, on_drop
        self.open: dict[int, IncomingTransfer] = {}  # in the order they opened
        self._unclaimed: OrderedDict[int, float] = OrderedDict()  # ended, unclaimed id -> when it ended
        self._ended: OrderedDict[int, str] = OrderedDict()  # ended id -> why it failed ("" if it did not)

    def claim(self, transfer_id: int, now: float) -> IncomingTransfer:
        """The transfer for its consumer: the one frames opened, or a new one waiting for them."""
        t = self.open.get(transfer_id)
        if t is None and transfer_id in self._ended:  # dropped, or claimed once already
            why = self._ended[transfer_id].removeprefix("DroppedError: ")
            t = self._new(transfer_id, now)
            t.fail(DroppedError(why or f"transfer {transfer_id} has already ended"))
        elif t is None:
            t = self._open(transfer_id, now)
        t.claimed = True
        if t.finished:
            self.open.pop(transfer_id, None)
            self._unclaimed.pop(transfer_id, None)
        return t

    def for_frame(self, transfer_id: int, now: float) -> IncomingTransfer | None:
        """Where a frame goes; None if its transfer has ended (skip the frame)."""
        t = self.open.get(transfer_id)
        if t is None and transfer_id not in self._ended:
            t = self._open(transfer_id, now)
        return None if t is None or t.finished else t

    def failure(self, transfer_id: int) -> str:
        """Why an ended transfer failed ("" if it did not, or is not remembered)."""
        return self._ended.get(transfer_id, "")

    def ended(self, t: IncomingTransfer, now: float) -> None:
        """Record that ``t`` completed or failed."""
        self._remember(t.id, "" if t.error is None else reason(t.error))
        if t.claimed:
            self.open.pop(t.id, None)
        elif t.id in self.open:
            self._unclaimed[t.id] = now

    def sweep(self, now: float) -> None:
        """Drop the transfers that ended unclaimed more than ``grace`` seconds ago."""
        while self._unclaimed:
            transfer_id, ended_at = next(iter(self._unclaimed.items()))
            if now - ended_at < self.grace:
                return
            self._drop(transfer_id, f"ended {now - ended_at:.1f} s ago and no consumer claimed it")

    def stalled(self, now: float, limit: float) -> list[IncomingTransfer]:
        """Started, unfinished transfers without progress for more than ``limit`` seconds and no payload
        being read (a payload still arriving, however slowly, is its connection's deadline to judge)."""
        return [
            t
            for t in self.open.values()
            if t.started and not t.finished and not t.receiving and now - t.last_progress > limit
        ]

    def _open(self, transfer_id: int, now: float) -> IncomingTransfer:
        if len(self.open) >= self.max_open:
            self._make_room()
        t = self._new(transfer_id, now)
        self.open[transfer_id] = t
        return t

    def _new(self, transfer_id: int, now: float) -> IncomingTransfer:
        return IncomingTransfer(transfer_id, self.max_transfer_bytes, now, self._allocate)

    def _make_room(self) -> None:
        full = f"the table of {self.max_open} transfers was full"
        if self._unclaimed:
            self._drop(next(iter(self._unclaimed)), f"ended and unclaimed when {full}")
            return
        oldest = next((t for t in self.open.values() if not t.claimed), None)
        if oldest is None:
            raise ProtocolError(f"more than {self.max_open} open transfers, all of them claimed")
        self._drop(oldest.id, f"unclaimed and unfinished when {full}")

    def _drop(self, transfer_id: int, why: str) -> None:
        t = self.open.pop(transfer_id)
        self._unclaimed.pop(transfer_id, None)
        cause = f"transfer {transfer_id} was dropped: {why}"
        t.fail(DroppedError(cause))  # if unfinished: later frames are skipped, its END is answered with the cause
        self._remember(transfer_id, f"DroppedError: {cause}")
        if self._on_drop is not None:
            self._on_drop(t, cause)

    def _remember(self, transfer_id: int, why: str) -> None:
        self._ended[transfer_id] = why
        self._ended.move_to_end(transfer_id)
        while len(self._ended) > FORGET_AFTER:
            self._ended.popitem(last=False)


def reason(error: TransferError) -> str:
    return f"{type(error).__name__}: {error}"[:1024]
