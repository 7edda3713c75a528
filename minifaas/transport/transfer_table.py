"""A receiver's transfers by id: the open ones, and why recently ended ones ended (sans-IO).

A frame for an id not seen before opens a transfer (up to ``max_open``), so
frames may arrive before the consumer asks for it. A frame for an id that
ended recently is not a new transfer: its frames are skipped, and the END of
one that failed is answered with the reason. A transfer leaves the table when
it has both ended and been claimed by its consumer. Time is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from minifaas.transport.errors import ProtocolError, TransferError
from minifaas.transport.incoming import IncomingTransfer

FORGET_AFTER = 4096  # ended transfer ids remembered, so late frames are skipped, not restarted


class TransferTable:
    def __init__(self, max_open: int, max_transfer_bytes: int, allocate: Callable[[int], torch.Tensor]) -> None:
        self.max_open, self.max_transfer_bytes, self._allocate = max_open, max_transfer_bytes, allocate
        self.open: dict[int, IncomingTransfer] = {}
        self._ended: OrderedDict[int, str] = OrderedDict()  # ended id -> why it failed ("" if it did not)

    def claim(self, transfer_id: int, now: float) -> IncomingTransfer:
        """The transfer for its consumer: the one frames opened, or a new one waiting for them."""
        t = self.open.get(transfer_id) or self._open(transfer_id, now)
        t.claimed = True
        if t.finished:
            del self.open[transfer_id]
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

    def ended(self, t: IncomingTransfer) -> None:
        """Record that ``t`` completed or failed."""
        self._ended[t.id] = "" if t.error is None else reason(t.error)
        while len(self._ended) > FORGET_AFTER:
            self._ended.popitem(last=False)
        if t.claimed:
            self.open.pop(t.id, None)

    def stalled(self, now: float, limit: float) -> list[IncomingTransfer]:
        """Started, unfinished transfers without progress for more than ``limit`` seconds."""
        return [t for t in self.open.values() if t.started and not t.finished and now - t.last_progress > limit]

    def _open(self, transfer_id: int, now: float) -> IncomingTransfer:
        if len(self.open) >= self.max_open:
            raise ProtocolError(f"more than {self.max_open} open transfers")
        t = IncomingTransfer(transfer_id, self.max_transfer_bytes, now, self._allocate)
        self.open[transfer_id] = t
        return t


def reason(error: TransferError) -> str:
    return f"{type(error).__name__}: {error}"[:1024]
