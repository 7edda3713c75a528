"""The receiver's transfer table, without sockets or an event loop: opening, ending, forgetting, stalls."""

from __future__ import annotations

import pytest
import torch

from minifaas.transport.errors import CorruptFrameError, ProtocolError
from minifaas.transport.transfer_table import FORGET_AFTER, TransferTable


def table(max_open: int = 4) -> TransferTable:
    return TransferTable(max_open, 1 << 20, lambda n: torch.empty(n, dtype=torch.uint8))


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
    t.ended(failed)
    assert 7 in t.open  # not claimed yet: its consumer still gets the error
    assert t.for_frame(7, now=1.0) is None and t.failure(7) == "CorruptFrameError: bad byte"
    assert t.claim(7, now=1.0) is failed and 7 not in t.open
    assert t.for_frame(7, now=2.0) is None  # late frames do not restart it
    for i in range(100, 100 + FORGET_AFTER):
        done = t.for_frame(i, now=3.0)
        assert done is not None and done.fail(CorruptFrameError("x"))
        t.claim(i, now=3.0)
        t.ended(done)
    assert t.failure(7) == "" and t.for_frame(7, now=4.0) is not None  # forgotten: a new transfer


def test_open_transfers_are_bounded() -> None:
    t = table(max_open=2)
    t.for_frame(1, now=0.0)
    t.claim(2, now=0.0)
    with pytest.raises(ProtocolError, match="open transfers"):
        t.for_frame(3, now=0.0)


def test_stalled_means_started_unfinished_and_quiet_for_longer_than_the_limit() -> None:
    t = table()
    quiet, waiting, busy = (t.for_frame(i, now=0.0) for i in range(3))
    assert quiet is not None and waiting is not None and busy is not None
    quiet.started = busy.started = True
    busy.last_progress = 9.0
    assert t.stalled(now=10.0, limit=5.0) == [quiet]
    assert t.stalled(now=4.0, limit=5.0) == []
