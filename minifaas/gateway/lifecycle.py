"""A request's lifecycle: one enum and the table of legal transitions.

    QUEUED -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED
    PREFILLING / TRANSFERRING -> FALLBACK -> PREFILLING   (prefill node or link lost: re-prefill locally)
    any live state -> MIGRATING -> PREFILLING             (decode node lost: prompt + output so far re-prefilled)
    any live state -> ABORTED (client gone) | FAILED (no way left to answer)

Prefill streams layers while it computes, so PREFILLING and TRANSFERRING
overlap in time; TRANSFERRING is entered when the prefill itself is done and
only the tail of the state is still crossing the link.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    FALLBACK = "fallback"
    MIGRATING = "migrating"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (Phase.FINISHED, Phase.ABORTED, Phase.FAILED)


_END = {Phase.ABORTED, Phase.FAILED}
_LOST = {Phase.MIGRATING} | _END  # a decode node can go at any live step
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.PREFILLING} | _END),
    Phase.PREFILLING: frozenset({Phase.TRANSFERRING, Phase.FALLBACK} | _LOST),
    Phase.TRANSFERRING: frozenset({Phase.DECODING, Phase.FALLBACK} | _LOST),
    Phase.FALLBACK: frozenset({Phase.PREFILLING} | _LOST),
    Phase.MIGRATING: frozenset({Phase.PREFILLING} | _END),
    Phase.DECODING: frozenset({Phase.FINISHED} | _LOST),
    Phase.FINISHED: frozenset(),
    Phase.ABORTED: frozenset(),
    Phase.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def advance(current: Phase, new: Phase) -> Phase:
    if new not in TRANSITIONS[current]:
        raise IllegalTransition(f"{current.name} -> {new.name} is not a legal transition")
    return new
