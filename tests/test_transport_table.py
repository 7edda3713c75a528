"""The receiver's transfer table, without sockets or an event loop: opening, ending, forgetting, stalls,
dropping what no consumer claims."""

from __future__ import annotations

import pytest
import torch

from minifaas.model.layer_state import LayerState, StateKind
from minifaas.net.errors import CorruptFrameError, DroppedError, ProtocolError
from minifaas.transport.receiver import FORGET_AFTER, IncomingTransfer, TransferTable


def table(max_open: int = 4, drops: list[tuple[int, str]] | None = None) -> TransferTable:
    def on_drop(t: IncomingTransfer, cause: str) -> None:
        assert drops is not None
        drops.append((t.id, cause))

    return TransferTable(max_open, 1 << 20, lambda n: torch.empty(n, dtype=torch.uint8), grace=5.0, on_drop=on_drop)


def completed(t: TransferTable, transfer_id: int, now: float) -> IncomingTransfer:
    """A transfer whose frames all came (one small layer), as the receiver completes it."""
    incoming = t.for_frame(transfer_id, now)
    assert incoming is not None
    layer = LayerState(0, StateKind.LINEAR_ATTENTION, 1, (("state", torch.zeros(1)),))
    incoming.assembly = None  # what deliver() does once the assembly is complete
    incoming.deliver([layer], now)
    incoming.complete = True
    t.ended(incoming, now)
    return incoming


def test_frames_open_a_transfer_that_its_consumer_then_claims() -> None:
    t = table()
    first = t.for_frame(1, now=0.0)
    assert first is not None and t.for_frame(1, now=1.0) is first
    assert t.claim(1, now=2.0) is first and first.claimed and 1 in t.open
    early = t.claim(2, now=2.0)  # the consumer asks before any frame came
    assert t.for_frame(2, now=3.0) is early


def test_an_ended_transfer_is_skipped_and_remembers_why_it_failed() -> None:
    t = table()
    failed = t.for_frame(7, now=0.0)
    assert failed is not None and failed.fail(CorruptFrameError("bad byte"))
    t.ended(failed, now=0.0)
    assert 7 in t.open  # not claimed yet: its consumer still gets the error
    assert t.for_frame(7, now=1.0) is None and t.failure(7) == "CorruptFrameError: bad byte"
    assert t.claim(7, now=1.0) is failed and 7 not in t.open
    assert t.for_frame(7, now=2.0) is None  # late frames do not restart it
    for i in range(100, 100 + FORGET_AFTER):
        done = t.for_frame(i, now=3.0)
        assert done is not None and done.fail(CorruptFrameError("x"))
        t.claim(i, now=3.0)
        t.ended(done, now=3.0)
    assert t.failure(7) == "" and t.for_frame(7, now=4.0) is not None  # forgotten: a new transfer


def test_claimed_open_transfers_are_bounded() -> None:
    t = table(max_open=2)
    t.claim(1, now=0.0)
    t.claim(2, now=0.0)
    with pytest.raises(ProtocolError, match="all of them claimed"):
        t.for_frame(3, now=0.0)


def test_an_ended_unclaimed_transfer_is_dropped_after_the_grace_and_its_late_consumer_is_told_why() -> None:
    drops: list[tuple[int, str]] = []
    t = table(drops=drops)
    completed(t, 1, now=0.0)
    t.sweep(now=4.9)
    assert 1 in t.open and drops == []  # a consumer a little late still gets it
    assert t.claim(1, now=4.9).complete and 1 not in t.open
    completed(t, 2, now=10.0)
    t.sweep(now=15.0)
    assert 2 not in t.open and drops == [(2, "transfer 2 was dropped: ended 5.0 s ago and no consumer claimed it")]
    late = t.claim(2, now=16.0)
    assert isinstance(late.error, DroppedError) and "no consumer claimed it" in str(late.error)
    assert t.for_frame(2, now=16.0) is None  # a late frame does not reopen it


def test_a_full_table_drops_the_oldest_ended_unclaimed_then_the_oldest_unclaimed_never_a_claimed_one() -> None:
    drops: list[tuple[int, str]] = []
    t = table(max_open=3, drops=drops)
    waiting = t.claim(1, now=0.0)  # a consumer waits for its frames
    completed(t, 2, now=0.0)
    unfinished = t.for_frame(3, now=0.0)  # frames came, nobody asked for it
    assert unfinished is not None
    assert t.for_frame(4, now=1.0) is not None and [d[0] for d in drops] == [2]
    assert "ended and unclaimed when the table of 3 transfers was full" in drops[0][1]
    assert t.for_frame(5, now=1.0) is not None and [d[0] for d in drops] == [2, 3]
    assert isinstance(unfinished.error, DroppedError) and t.failure(3).startswith("DroppedError")
    assert t.for_frame(3, now=2.0) is None  # its late frames are skipped, its END answered with the cause
    assert set(t.open) == {1, 4, 5} and not waiting.finished
    t.claim(4, now=2.0)
    t.claim(5, now=2.0)
    with pytest.raises(ProtocolError, match="all of them claimed"):
        t.for_frame(6, now=2.0)


def test_stalled_means_started_unfinished_and_quiet_for_longer_than_the_limit() -> None:
    t = table()
    quiet, waiting, busy = (t.for_frame(i, now=0.0) for i in range(3))
    assert quiet is not None and waiting is not None and busy is not None
    quiet.started = busy.started = True
    busy.last_progress = 9.0
    assert t.stalled(now=10.0, limit=5.0) == [quiet]
    assert t.stalled(now=4.0, limit=5.0) == []
