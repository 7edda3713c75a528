"""Store and evict events: how a pool keeps the global cache manager current.

A pool appends one event per change to its contents (a new entry, a new holder
of an entry, an eviction) and the process that owns the pool ships them to the
gateway in order, where ``GlobalCacheManager.apply`` replays them. Events carry
metadata only, never payloads; ``at`` is the time the caller passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from minifaas.cache.block_hash import BlockKey
from minifaas.cache.prefix_index import EntryKind


class EventKind(StrEnum):
    STORE = "store"  # ``node`` now holds the entry (it may have been present already)
    EVICT = "evict"  # the entry left the pool, for every holder


@dataclass(frozen=True, slots=True)
class CacheEvent:
    kind: EventKind
    entry: EntryKind
    pool: str  # the pool's name ("cluster" on the wire)
    node: str
    key: BlockKey
    parent: BlockKey  # the block before it: the previous block, or a snapshot's last full block
    length: int  # tokens covered: a block's end, or a snapshot's exact length
    nbytes: int
    at: float

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "entry": self.entry.value,
            "cluster": self.pool,
            "node": self.node,
            "key": self.key.hex(),
            "parent": self.parent.hex(),
            "length": self.length,
            "nbytes": self.nbytes,
            "at": self.at,
        }

    @classmethod
    def from_json(cls, obj: dict[str, object]) -> CacheEvent:
        return cls(
            EventKind(str(obj["kind"])),
            EntryKind(str(obj["entry"])),
            str(obj["cluster"]),
            str(obj["node"]),
            bytes.fromhex(str(obj["key"])),
            bytes.fromhex(str(obj["parent"])),
            int(obj["length"]),  # type: ignore[call-overload]
            int(obj["nbytes"]),  # type: ignore[call-overload]
            float(obj["at"]),  # type: ignore[arg-type]
        )
