"""A hybrid prefix cache pool (one node's; one cluster's in the simulator): each cached block or snapshot
(``Entry``), its bytes, and which may be evicted. Sans-IO; payloads are kept by reference, never mutated.

A prefill ``acquire``s its hit as a pinned ``Lease``, stores what it computed with ``put_block`` and
``put_snapshot`` in order, then releases the lease. Eviction is least recently used by bytes and never takes a
pinned entry or one that others hang from, so the cached set stays prefix-closed.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from minifaas.cache.pool_config import PoolConfig, snapshot_placement
from minifaas.cache.prefix_index import BlockKey, CacheEvent, EntryKind, EventKind, Match, PrefixIndex, PromptKeys
from minifaas.policy.snapshot_policy import SnapshotInput

P = TypeVar("P")


@dataclass(slots=True, eq=False)
class Entry(Generic[P]):
    kind: EntryKind
    key: BlockKey
    parent: BlockKey
    length: int
    nbytes: int
    payload: P | None
    refs: int = 0  # leases holding it: it is not evicted while any does
    dependents: int = 0  # stored children (blocks and snapshots) that need this block: nor while any does


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


def _slot(kind: EntryKind, key: BlockKey) -> bytes:
    """Where an entry sits in the pool: a block under its key, a snapshot under its key marked."""
    return key if kind is EntryKind.BLOCK else b"s" + key


_COUNT_NAMES = {  # the store counters per entry kind (duplicate, orphan, no room, stored), made once: a hot path
    kind: (f"{kind}_store_dups", f"{kind}_store_skipped_orphan", f"{kind}_store_rejected_no_room", f"{kind}s_stored")
    for kind in EntryKind
}


class HybridPrefixPool(Generic[P]):
    def __init__(self, config: PoolConfig, node: str = "") -> None:
        self.config = config
        self.node = node  # default holder recorded in events
        self.index = PrefixIndex(config.needs_snapshot)
        self.snapshots = snapshot_placement(config)
        self.counts: Counter[str] = Counter()
        self.prefix_bytes = 0
        self._entries: OrderedDict[bytes, Entry[P]] = OrderedDict()  # by _slot, LRU first
        self._events: list[CacheEvent] = []

    @property
    def used_bytes(self) -> int:
        return self.prefix_bytes

    @property
    def free_bytes(self) -> int:
        return self.config.capacity_bytes - self.used_bytes

    def entry(self, kind: EntryKind, key: BlockKey) -> Entry[P] | None:
        return self._entries.get(_slot(kind, key))

    def entries(self) -> list[Entry[P]]:
        """Everything held, least recently used first."""
        return list(self._entries.values())

    def match(self, prompt: PromptKeys, limit: int | None = None) -> Match:
        """Look without touching: no pins, no LRU update, no counts."""
        if not self.config.enabled:
            return Match(0, 0, None)
        return self.index.match(prompt, limit)

    def acquire(self, prompt: PromptKeys, limit: int | None = None, kv_only: bool = False) -> Lease[P]:
        """Pin and return the usable hit. ``kv_only``: the full-attention blocks alone, no snapshot
        needed (a decode node that receives only the rest of the KV over the link)."""
        self._check_block_size(prompt)
        m = self.match(prompt, limit)
        if kv_only:
            limit = prompt.num_tokens if limit is None else limit
            kv_blocks = min(m.kv_blocks, max(0, limit) // prompt.block_size)
            m = Match(kv_blocks * prompt.block_size, kv_blocks, None)
        block_keys = prompt.block_keys[: m.hit_tokens // prompt.block_size]
        blocks = tuple(self._entries[k] for k in block_keys)
        snapshot = self._entries[_slot(EntryKind.SNAPSHOT, m.snapshot_key)] if m.snapshot_key else None
        for e in (*blocks, *([snapshot] if snapshot else [])):
            e.refs += 1
        self.touch(prompt, m.hit_tokens)
        kind = "kv_" if kv_only else ""
        self.counts[f"{kind}lookups"] += 1
        self.counts[f"{kind}lookup_tokens"] += prompt.num_tokens
        self.counts[f"{kind}hit_tokens"] += m.hit_tokens
        self.counts[f"{kind}lookups_hit" if m.hit_tokens else f"{kind}lookups_miss"] += 1
        return Lease(m.hit_tokens, blocks, snapshot)

    def release(self, lease: Lease[P]) -> None:
        if lease.released:
            raise ValueError("lease released twice")
        lease.released = True
        for e in (*lease.blocks, *([lease.snapshot] if lease.snapshot else [])):
            e.refs -= 1

    def touch(self, prompt: PromptKeys, length: int) -> None:
        """Mark the prefix of ``length`` recently used, deepest entry first, so the LRU end
        holds leaves and a prefix's root outlives its branches."""
        snapshot_key = prompt.key_at(length) if length else None
        if snapshot_key is not None:
            self._touch(_slot(EntryKind.SNAPSHOT, snapshot_key))
        self._touch_blocks(reversed(prompt.block_keys[: length // prompt.block_size]))

    def snapshot_points(self, start: int, num_tokens: int, seen_tokens: int = 0) -> list[int]:
        """Lengths in (start, num_tokens] at which a prefill of a prompt should snapshot its state;
        ``seen_tokens``: the prompt's longest block prefix already stored (its branch point)."""
        c = self.config
        return self.snapshots.points(SnapshotInput(start, num_tokens, c.block_size, c.needs_snapshot, seen_tokens))

    def put_block(
        self, prompt: PromptKeys, index: int, now: float, nbytes: int, payload: P | None = None, node: str | None = None
    ) -> bool:
        """Store full block ``index`` of ``prompt``; True if it is in the pool afterwards."""
        self._check_block_size(prompt)
        keys = prompt.block_keys
        parent = keys[index - 1] if index else prompt.root  # parent_of(index * block_size)
        entry = Entry(EntryKind.BLOCK, keys[index], parent, (index + 1) * prompt.block_size, nbytes, payload)
        return self._put(entry, index > 0, now, node)

    def put_snapshot(
        self, prompt: PromptKeys, length: int, now: float, nbytes: int, payload: P | None = None,
        node: str | None = None,
    ) -> bool:  # fmt: skip
        """Store the state valid at exactly ``length`` tokens; True if it is in the pool afterwards."""
        self._check_block_size(prompt)
        key = prompt.key_at(length)
        if key is None or length == 0:
            raise ValueError(f"no key for a snapshot at {length} tokens of this prompt")
        entry = Entry(EntryKind.SNAPSHOT, key, prompt.parent_of(length), length, nbytes, payload)
        return self._put(entry, length >= prompt.block_size, now, node)

    def drain_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    def inventory(self, now: float) -> list[CacheEvent]:
        """STORE events for everything held, parents first: how a (re)started manager catches up."""
        out = []
        for e in sorted(self._entries.values(), key=lambda e: (e.length, e.kind != EntryKind.BLOCK)):
            for holder in sorted(self.index.holders(e.kind, e.key)):
                out.append(self._event(EventKind.STORE, e, holder, now))
        return out

    def _put(self, entry: Entry[P], needs_parent: bool, now: float, node: str | None) -> bool:
        node = self.node if node is None else node
        if not self.config.enabled:
            self.counts["store_skipped_disabled"] += 1
            return False
        slot, (dups, orphans, no_room, _) = _slot(entry.kind, entry.key), _COUNT_NAMES[entry.kind]
        existing = self._entries.get(slot)
        if existing is not None:
            self.counts[dups] += 1
            self._touch(slot)
            if self.index.add(entry.kind, entry.key, node, entry.parent, entry.length) and self.config.events:
                self._events.append(self._event(EventKind.STORE, existing, node, now))
            return True
        parent_entry = self._entries.get(entry.parent)  # a block's slot is its key
        if parent_entry is None and needs_parent:
            self.counts[orphans] += 1  # its prefix is gone: unreachable
            return False
        if self.free_bytes < entry.nbytes:
            if parent_entry is not None:
                parent_entry.refs += 1  # keep the parent while making room for its child
            room = self._make_room(entry.nbytes, now)
            if parent_entry is not None:
                parent_entry.refs -= 1
            if not room:
                self.counts[no_room] += 1
                return False
        self._insert(entry, parent_entry, now, node)
        return True

    def _insert(self, entry: Entry[P], parent_entry: Entry[P] | None, now: float, node: str) -> Entry[P]:
        """Add an entry known to be missing, with room for it, under ``parent_entry``."""
        self._entries[_slot(entry.kind, entry.key)] = entry
        self.index.add(entry.kind, entry.key, node, entry.parent, entry.length)
        if parent_entry is not None:
            parent_entry.dependents += 1
        self.prefix_bytes += entry.nbytes
        self.counts[_COUNT_NAMES[entry.kind][3]] += 1  # "<kind>s_stored"
        if self.config.events:
            self._events.append(self._event(EventKind.STORE, entry, node, now))
        return entry

    def _make_room(self, nbytes: int, now: float) -> bool:
        if nbytes > self.config.capacity_bytes:
            return False
        while self.free_bytes < nbytes:
            victim = next((e for e in self._entries.values() if e.refs == 0 and e.dependents == 0), None)
            if victim is None:
                return False
            self._evict(victim, now)
        return True

    def _evict(self, entry: Entry[P], now: float) -> None:
        del self._entries[_slot(entry.kind, entry.key)]
        self.index.remove(entry.kind, entry.key, entry.parent, entry.length)
        parent_entry = self._entries.get(entry.parent)
        if parent_entry is not None:
            parent_entry.dependents -= 1
        self.prefix_bytes -= entry.nbytes
        self.counts[f"{entry.kind}s_evicted"] += 1
        self.counts["evicted_bytes"] += entry.nbytes
        if self.config.events:
            self._events.append(self._event(EventKind.EVICT, entry, "", now))

    def _touch_blocks(self, keys: Iterable[BlockKey]) -> None:
        """The blocks are used now: last in the LRU order, the one evicted last."""
        entries = self._entries
        for key in keys:
            if key in entries:
                entries.move_to_end(key)

    def _touch(self, slot: bytes) -> None:
        if slot in self._entries:
            self._entries.move_to_end(slot)

    def _event(self, kind: EventKind, e: Entry[P], node: str, now: float) -> CacheEvent:
        return CacheEvent(kind, e.kind, self.config.name, node, e.key, e.parent, e.length, e.nbytes, now)

    def _check_block_size(self, prompt: PromptKeys) -> None:
        if prompt.block_size != self.config.block_size:
            raise ValueError(f"prompt keyed with blocks of {prompt.block_size}, pool uses {self.config.block_size}")
