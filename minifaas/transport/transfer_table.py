"""A receiver's transfers by id: the open ones, and why recently ended ones ended (sans-IO).

A frame for an id not seen before opens a transfer, so frames may arrive before the
consumer asks for it. A frame for an id that ended recently is not a new transfer: its
frames are skipped, and the END of one that failed is answered with the reason. A
transfer leaves the table once it has ended and been claimed by its consumer.

Nothing waits for a consumer forever. A transfer that ended unclaimed (a prefill that
completed into a restarted decode worker that never expected it) is kept ``grace``
seconds for a consumer that is late, then dropped. The table holds at most
``max_open`` transfers; when it is full a new one takes the place of the oldest that
ended unclaimed, else of the oldest unfinished one no consumer has claimed. Only
claimed, unfinished transfers are never pushed out, so no sender can wedge the table.
Every drop goes to ``on_drop`` with its cause; a consumer that comes for a dropped
transfer gets a transfer already failed with that cause. Time is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from minifaas.net.errors import DroppedError, ProtocolError, TransferError
from minifaas.transport.incoming import IncomingTransfer

FORGET_AFTER = 4096  # ended transfer ids remembered, so late frames are skipped, not restarted
OnDrop = Callable[[IncomingTransfer, str], None]


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
