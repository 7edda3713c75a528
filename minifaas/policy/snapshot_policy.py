"""Where a prefill keeps linear-state snapshots: the points a later prompt can actually load.

A hybrid model's linear-attention and sliding-window state is valid at one length only, so a cached prefix
is usable only up to a length where a snapshot was taken. Every snapshot inside a prompt ends a forward there
(more, smaller forwards, and a copy of the state) on every request, reused or not; a snapshot at the
prompt's end costs only the copy.

``SnapshotPolicy.REUSE`` (the serving default): the prompt's end (the next turn of a chat continues from
there) and its branch point, the end of the longest block prefix an earlier prompt already stored: a prefix
seen twice is the evidence that a third prompt will want it. A prompt that shares nothing pays no split.
``SnapshotPolicy.INTERVAL``: every ``interval_blocks`` blocks plus the end (0: the end only).

Sans-IO and pure: the caller passes what its pool (or the gateway's directory) knows about the prompt.
"""

from __future__ import annotations

from enum import StrEnum


class SnapshotPolicy(StrEnum):
    REUSE = "reuse"
    INTERVAL = "interval"


def snapshot_points(
    policy: SnapshotPolicy,
    start: int,
    num_tokens: int,
    block_size: int,
    interval_blocks: int,
    needs_snapshot: bool,
    seen_tokens: int = 0,
) -> list[int]:
    """Lengths in (start, num_tokens], ascending, at which a prefill of tokens [start, num_tokens) keeps its
    state. ``seen_tokens``: the longest block-aligned prefix of this prompt already stored (the branch point).

    A dense model (``needs_snapshot`` False) reuses any block prefix without a snapshot: it keeps one only at
    an end that is not block-aligned (the partial block's KV)."""
    if num_tokens <= start:
        return []
    end = [num_tokens] if needs_snapshot or num_tokens % block_size else []
    if not needs_snapshot:
        return end
    if policy is SnapshotPolicy.INTERVAL:
        step = interval_blocks * block_size
        inner = list(range((start // step + 1) * step, num_tokens, step)) if step else []
        return inner + end
    branch = seen_tokens - seen_tokens % block_size
    return ([branch] if start < branch < num_tokens else []) + end
