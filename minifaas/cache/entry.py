"""What a pool holds (an Entry: one block or one snapshot, its bytes and payload) and what it
lends (a Lease: the entries of one hit, pinned until released).

A payload is whatever the pool's owner stores: a list of LayerState in the live
system, None in the simulator. ``refs`` counts leases holding the entry;
``dependents`` counts stored entries that need it as their parent. Either one
keeps the entry from eviction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from minifaas.cache.block_hash import BlockKey
from minifaas.cache.prefix_index import EntryKind

P = TypeVar("P")


@dataclass(slots=True, eq=False)
class Entry(Generic[P]):
    kind: EntryKind
    key: BlockKey
    parent: BlockKey
    length: int
    nbytes: int
    payload: P | None
    last_used: float
    refs: int = 0
    dependents: int = 0  # stored children (blocks and snapshots) that need this block


@dataclass(slots=True, eq=False)
class Lease(Generic[P]):
    """A pinned hit: the blocks inside [0, hit_tokens) in order, and the snapshot at hit_tokens."""

    hit_tokens: int
    blocks: tuple[Entry[P], ...]
    snapshot: Entry[P] | None
    released: bool = field(default=False)

    @property
    def block_payloads(self) -> list[P | None]:
        return [e.payload for e in self.blocks]

    @property
    def snapshot_payload(self) -> P | None:
        return self.snapshot.payload if self.snapshot else None
