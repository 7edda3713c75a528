"""Where a prefill keeps linear-state snapshots: the lengths a later prompt can load its state from.

A snapshot inside a prompt splits its forward, so ``ReuseSnapshots`` keeps only the prompt's end and its branch
point (the longest prefix already stored), while ``IntervalSnapshots`` keeps one every ``interval_blocks`` too.
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
    """The end, where every policy keeps the state (if any token is computed); a dense model only when the end is
    not block-aligned (the partial block's KV)."""
    return [p.num_tokens] if p.num_tokens > p.start and (p.needs_snapshot or p.num_tokens % p.block_size) else []


class ReuseSnapshots:
    """The ``reuse`` policy, the serving default: a prefix seen twice is the evidence that a third prompt will
    want it, and a prompt that shares nothing pays no split."""

    def points(self, p: SnapshotInput) -> list[int]:
        if p.num_tokens <= p.start or not p.needs_snapshot:
            return prompt_end(p)
        branch = p.seen_tokens - p.seen_tokens % p.block_size
        return ([branch] if p.start < branch < p.num_tokens else []) + prompt_end(p)


class IntervalSnapshots:
    """The ``interval`` policy: a snapshot every ``interval_blocks`` blocks as well as the end (0: the end only)."""

    def __init__(self, interval_blocks: int = 8) -> None:
        if type(interval_blocks) is not int or interval_blocks < 0:  # given as a flag: any JSON value
            raise ValueError(f"interval_blocks must be an integer >= 0, got {interval_blocks!r}")
        self.interval_blocks = interval_blocks

    def points(self, p: SnapshotInput) -> list[int]:
        if p.num_tokens <= p.start or not p.needs_snapshot:
            return prompt_end(p)
        step = self.interval_blocks * p.block_size
        inner = list(range((p.start // step + 1) * step, p.num_tokens, step)) if step else []
        return inner + prompt_end(p)
