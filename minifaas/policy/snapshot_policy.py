"""Where a prefill keeps linear-state snapshots: the points a later prompt can actually load.

A hybrid model's linear-attention and sliding-window state is valid at one
length only, so a cached prefix is usable only up to a length where a snapshot
was taken. Every snapshot inside a prompt ends a forward there: the prefill is
split into more, smaller forwards and the state is copied out, on every request
whether or not anything is ever reused. Measured live on a Mooncake replay with
snapshots every 4 blocks, only 5% of prompt tokens hit and TTFT p90 was 1.3-1.6x
that of no cache (``benchmarks/bench_prefix_cache.py``). A snapshot at the
prompt's end costs no extra forward (the state is there anyway), only a copy.

Two policies (``SnapshotPolicy``):

- ``reuse`` (the serving default): a snapshot at the prompt's end (the next turn
  of a chat continues from there) and one at the prompt's branch point, the end of
  the longest block prefix some earlier prompt already stored: a prefix seen twice
  is the evidence that a third prompt will want it (the branch points of
  SGLang's Mamba radix cache). A prompt that shares nothing pays no split.
- ``interval``: the earlier rule, a snapshot every ``interval_blocks`` blocks
  plus the end (``interval_blocks = 0``: the end only), whatever the reuse.

Sans-IO and pure: the caller passes what its pool (or the gateway's directory)
knows about the prompt.
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
