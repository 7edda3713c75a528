"""An incoming transfer as its consumer sees it: layer states, in layer order, as each completes.

    incoming = receiver.transfer(transfer_id)
    async for layer in incoming:      # LayerState 0, 1, 2, ... as soon as each is whole
        ...
    state = await incoming.model_state()   # or: wait for all of them

Iteration ends after the last layer, or raises the ``TransferError`` that ended
the transfer; by then the receiver has dropped the partial state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import torch

from minifaas.model.layer_state import LayerState, ModelState
from minifaas.net.channel import Channel
from minifaas.net.errors import TransferError
from minifaas.transport.reassembly import Reassembly

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
