"""Where a prefill keeps linear-state snapshots: the points a later prompt can actually load.

A hybrid model's linear-attention and sliding-window state is valid at one length only, so a cached prefix
is usable only up to a length where a snapshot was taken. Every snapshot inside a prompt ends a forward there
(more, smaller forwards, and a copy of the state) on every request, reused or not; a snapshot at the
prompt's end costs only the copy.

``ReuseSnapshots`` (``reuse``, the serving default): the prompt's end (the next turn of a chat continues from
there) and its branch point, the end of the longest block prefix an earlier prompt already stored: a prefix
seen twice is the evidence that a third prompt will want it. A prompt that shares nothing pays no split.
``IntervalSnapshots`` (``interval``): every ``interval_blocks`` blocks plus the end (0: the end only).

Sans-IO and pure: the caller passes what its pool (or the gateway's directory) knows about the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SnapshotInput:
    """A prefill of tokens [start, num_tokens) about to run, as the snapshot policy sees it."""

    start: int  # tokens already loaded from the cache
    num_tokens: int  # the prompt's length
    block_size: int  # tokens per full-attention block
    needs_snapshot: bool = True  # False for a dense model: any block prefix is usable without a snapshot
    seen_tokens: int = 0  # the longest block-aligned prefix of this prompt already stored (the branch point)


def prompt_end(p: SnapshotInput) -> list[int]:
    """The end, where every policy keeps the state; a dense model only when the end is not block-aligned
    (the partial block's KV)."""
    return [p.num_tokens] if p.needs_snapshot or p.num_tokens % p.block_size else []


class ReuseSnapshots:
    def points(self, p: SnapshotInput) -> list[int]:
        """Lengths in (start, num_tokens], ascending, at which the prefill keeps its state."""
        if p.num_tokens <= p.start:
            return []
        if not p.needs_snapshot:
            return prompt_end(p)
        branch = p.seen_tokens - p.seen_tokens % p.block_size
        return ([branch] if p.start < branch < p.num_tokens else []) + prompt_end(p)


class IntervalSnapshots:
    def __init__(self, interval_blocks: int = 8) -> None:
        if interval_blocks < 0:
            raise ValueError(f"interval_blocks must be >= 0, got {interval_blocks}")
        self.interval_blocks = interval_blocks

    def points(self, p: SnapshotInput) -> list[int]:
        """Lengths in (start, num_tokens], ascending, at which the prefill keeps its state."""
        if p.num_tokens <= p.start:
            return []
        if not p.needs_snapshot:
            return prompt_end(p)
        step = self.interval_blocks * p.block_size
        inner = list(range((p.start // step + 1) * step, p.num_tokens, step)) if step else []
        return inner + prompt_end(p)
