"""Which cached prefixes exist, and who holds them: the matching half of the cache.

Metadata only, no payloads, so the per-cluster pool (which also owns the bytes)
and the gateway's global manager (which only hears store/evict events) share one
matching algorithm.

Two kinds of entry:
- a BLOCK is the full-attention KV of one aligned block, under its chained key;
  blocks match by longest prefix.
- a SNAPSHOT is the state valid at exactly one length n (linear-attention and
  sliding-window layers, plus the full-attention KV of the partial block before
  n), under ``key_at(n)``, indexed by its parent block so a lookup only visits
  snapshots that can lie on the prompt's path.

The usable hit is the longest n such that every full block inside [0, n) is
present and a snapshot exists at exactly n. Models without fixed-size state
(dense) need no snapshot at block boundaries: the block prefix alone is usable.
Each entry records the nodes that stored it, so a lookup can be asked for the
usable hit of one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from minifaas.cache.block_hash import BlockKey, PromptKeys


class EntryKind(StrEnum):
    BLOCK = "block"
    SNAPSHOT = "snapshot"


@dataclass(frozen=True, slots=True)
class Match:
    hit_tokens: int  # usable: blocks present and a snapshot at exactly this length
    kv_blocks: int  # leading full blocks present, snapshot or not
    snapshot_key: BlockKey | None  # the snapshot that makes the hit usable, if one is needed

    def kv_tokens(self, block_size: int) -> int:
        """Full-attention KV present: the block prefix, or the hit if its snapshot reaches further."""
        return max(self.kv_blocks * block_size, self.hit_tokens)


class PrefixIndex:
    def __init__(self, needs_snapshot: bool = True) -> None:
        self.needs_snapshot = needs_snapshot
        self.blocks: dict[BlockKey, set[str]] = {}
        self.snapshots: dict[BlockKey, set[str]] = {}
        self._snapshot_lengths: dict[BlockKey, dict[int, int]] = {}  # parent -> length -> count

    def __len__(self) -> int:
        return len(self.blocks) + len(self.snapshots)

    def add(self, kind: EntryKind, key: BlockKey, node: str, parent: BlockKey = b"", length: int = 0) -> bool:
        """Record that ``node`` holds the entry; True if the entry or this holder is new."""
        table = self.blocks if kind is EntryKind.BLOCK else self.snapshots
        holders = table.get(key)
        if holders is None:
            table[key] = {node}
            if kind is EntryKind.SNAPSHOT:
                lengths = self._snapshot_lengths.setdefault(parent, {})
                lengths[length] = lengths.get(length, 0) + 1
            return True
        if node in holders:
            return False
        holders.add(node)
        return True

    def remove(self, kind: EntryKind, key: BlockKey, parent: BlockKey = b"", length: int = 0) -> bool:
        table = self.blocks if kind is EntryKind.BLOCK else self.snapshots
        if table.pop(key, None) is None:
            return False
        if kind is EntryKind.SNAPSHOT:
            lengths = self._snapshot_lengths[parent]
            lengths[length] -= 1
            if not lengths[length]:
                del lengths[length]
            if not lengths:
                del self._snapshot_lengths[parent]
        return True

    def holders(self, kind: EntryKind, key: BlockKey) -> set[str]:
        table = self.blocks if kind is EntryKind.BLOCK else self.snapshots
        return table.get(key, set())

    def match(self, prompt: PromptKeys, limit: int | None = None, node: str | None = None) -> Match:
        """Longest usable prefix of ``prompt`` no longer than ``limit`` (held by ``node``, if given)."""
        limit = prompt.num_tokens if limit is None else max(0, min(limit, prompt.num_tokens))
        kv_blocks = 0
        for key in prompt.block_keys:
            if not self._held(self.blocks, key, node):
                break
            kv_blocks += 1
        size = prompt.block_size
        for j in range(min(kv_blocks, limit // size), -1, -1):
            lengths = self._snapshot_lengths.get(prompt.parent_of(j * size), {})
            for n in sorted((n for n in lengths if j * size <= n < (j + 1) * size and n <= limit), reverse=True):
                key = prompt.key_at(n)
                if key is not None and self._held(self.snapshots, key, node):
                    return Match(n, kv_blocks, key)
            if j and not self.needs_snapshot:
                return Match(j * size, kv_blocks, None)
        return Match(0, kv_blocks, None)

    @staticmethod
    def _held(table: dict[BlockKey, set[str]], key: BlockKey, node: str | None) -> bool:
        holders = table.get(key)
        return holders is not None and (node is None or node in holders)
