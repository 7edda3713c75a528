"""Which cached prefixes exist and which nodes hold them: the metadata half of the cache.

A block's key hashes the key before it with the block's tokens, so one key names the whole prefix up to the
block's end (``PromptKeys.key_at(n)``: any length n); the chain starts at a root made from the model's name.
``PrefixIndex`` finds a prompt's usable hit: the longest length whose full blocks are all present and that has a
snapshot at exactly that length (a model without fixed-size state needs none at block ends). ``GlobalCacheManager``
mirrors each pool's index from its ``CacheEvent``s; the gateway's ``PrefixDirectory`` keeps one per prefill node
and per decode node, and its answer is a forecast: the request records what the node's pool really held.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

BlockKey = bytes
KEY_BYTES = 16


def root_key(namespace: str) -> BlockKey:
    return hashlib.blake2b(namespace.encode(), digest_size=KEY_BYTES, person=b"minifaas-root").digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int64, whatever the host's byte order."""
    arr = array("q", tokens)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def chain(parent: BlockKey, content: bytes) -> BlockKey:
    # the parent has a fixed length, so parent + content parses one way only
    return hashlib.blake2b(parent + content, digest_size=KEY_BYTES).digest()


@dataclass(frozen=True, slots=True)
class PromptKeys:
    root: BlockKey
    block_size: int
    num_tokens: int
    block_keys: tuple[BlockKey, ...]  # one per FULL block
    end_key: BlockKey  # key_at(num_tokens)
    tokens: Sequence[int] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_tokens < 0:
            raise ValueError(f"need block_size >= 1 and num_tokens >= 0, got {self.block_size}, {self.num_tokens}")
        if len(self.block_keys) != self.num_tokens // self.block_size:
            raise ValueError(f"{self.num_tokens} tokens make {self.num_tokens // self.block_size} full blocks")

    @classmethod
    def from_tokens(cls, tokens: Sequence[int], block_size: int, namespace: str = "") -> PromptKeys:
        root = root_key(namespace)
        keys: list[BlockKey] = []
        parent = root
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = chain(parent, token_bytes(tokens[start : start + block_size]))
            keys.append(parent)
        tail = tokens[len(keys) * block_size :]
        end = chain(parent, token_bytes(tail)) if tail else parent
        return cls(root, block_size, len(tokens), tuple(keys), end, tuple(tokens))

    @property
    def num_full_blocks(self) -> int:
        return len(self.block_keys)

    def parent_of(self, n: int) -> BlockKey:
        """Key of the last full block inside the prefix of length n (the root if none)."""
        j = n // self.block_size
        return self.block_keys[j - 1] if j else self.root

    def keyed_lengths(self, low: int, high: int) -> tuple[int, ...] | None:
        """The lengths in [low, high] that have a key, longest first; None when every length has one
        (the tokens are known). Without tokens only block boundaries and the prompt's end are keyed."""
        if self.tokens is not None:
            return None
        ends = (self.num_tokens, *range(high - high % self.block_size, low - 1, -self.block_size))
        return tuple(n for n in dict.fromkeys(ends) if low <= n <= high)

    def key_at(self, n: int) -> BlockKey | None:
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"length {n} outside 0..{self.num_tokens}")
        if n == self.num_tokens:
            return self.end_key
        start = n - n % self.block_size
        if start == n:
            return self.parent_of(n)
        if self.tokens is None:
            return None
        return chain(self.parent_of(n), token_bytes(self.tokens[start:n]))


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
        self._held_by: dict[str, int] = {}  # node -> entries it holds

    def add(self, kind: EntryKind, key: BlockKey, node: str, parent: BlockKey = b"", length: int = 0) -> bool:
        """Record that ``node`` holds the entry; True if the entry or this holder is new."""
        table = self.blocks if kind is EntryKind.BLOCK else self.snapshots
        holders = table.get(key)
        if holders is None:
            table[key] = {node}
            if kind is EntryKind.SNAPSHOT:
                lengths = self._snapshot_lengths.setdefault(parent, {})
                lengths[length] = lengths.get(length, 0) + 1
        elif node in holders:
            return False
        else:
            holders.add(node)
        self._held_by[node] = self._held_by.get(node, 0) + 1
        return True

    def remove(self, kind: EntryKind, key: BlockKey, parent: BlockKey = b"", length: int = 0) -> bool:
        table = self.blocks if kind is EntryKind.BLOCK else self.snapshots
        holders = table.pop(key, None)
        if holders is None:
            return False
        for holder in holders:
            self._held_by[holder] -= 1
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

    def holds_all(self, node: str) -> bool:
        """True if ``node`` holds every entry: its own match is then the index's match."""
        return self._held_by.get(node, 0) == len(self.blocks) + len(self.snapshots)

    def leading_blocks(self, prompt: PromptKeys, start: int = 0, end: int | None = None) -> int:
        """How many of the prompt's full blocks [start, end) are present, counted from ``start`` up to the
        first missing one. Bisection finds it because the blocks present are prefix-closed: along one prompt's
        chain they are a leading run."""
        keys, blocks = prompt.block_keys, self.blocks
        low, high = start, len(keys) if end is None else end
        while low < high:
            mid = (low + high) // 2
            if keys[mid] in blocks:
                low = mid + 1
            else:
                high = mid
        return low - start

    def match(self, prompt: PromptKeys, limit: int | None = None, node: str | None = None) -> Match:
        """Longest usable prefix of ``prompt`` no longer than ``limit`` (held by ``node``, if given)."""
        limit = prompt.num_tokens if limit is None else max(0, min(limit, prompt.num_tokens))
        if node is not None and self.holds_all(node):
            node = None  # its entries are all the entries
        if node is None:
            kv_blocks = self.leading_blocks(prompt)
        else:  # a node's own entries need not be prefix-closed (it stores what it computed)
            kv_blocks = 0
            for key in prompt.block_keys:
                holders = self.blocks.get(key)
                if holders is None or node not in holders:
                    break
                kv_blocks += 1
        size, keys, snapshot_lengths = prompt.block_size, prompt.block_keys, self._snapshot_lengths
        # from the longest candidate down; most parents have no snapshot, so look before sorting
        for j in range(min(kv_blocks, limit // size), -1, -1):
            lengths = snapshot_lengths.get(keys[j - 1] if j else prompt.root)  # parent_of(j * size)
            if lengths:
                low, high = j * size, min((j + 1) * size - 1, limit)
                keyed = prompt.keyed_lengths(low, high)
                for n in sorted(lengths, reverse=True) if keyed is None else [n for n in keyed if n in lengths]:
                    if low <= n <= high:
                        key = prompt.key_at(n)
                        holders = self.snapshots.get(key) if key is not None else None
                        if holders is not None and (node is None or node in holders):
                            return Match(n, kv_blocks, key)
            if j and not self.needs_snapshot:
                return Match(j * size, kv_blocks, None)
        return Match(0, kv_blocks, None)


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


@dataclass(frozen=True, slots=True)
class PoolMatch:
    pool: str
    hit_tokens: int  # usable from the pool, by any node that can load from it
    kv_prefix_tokens: int  # full-attention KV present (snapshot or not): what need not be resent
    node_hits: dict[str, int] = field(default_factory=dict)  # usable over each node's own entries


class GlobalCacheManager:
    def __init__(self, pools: Iterable[str], needs_snapshot: bool = True) -> None:
        self.needs_snapshot = needs_snapshot
        self.indexes = {name: PrefixIndex(needs_snapshot) for name in pools}
        self.nodes: dict[str, set[str]] = {name: set() for name in self.indexes}
        self.counts: Counter[str] = Counter()

    def apply(self, events: Iterable[CacheEvent]) -> None:
        for event in events:
            index = self.indexes.get(event.pool)
            if index is None:
                self.counts["events_unknown_cluster"] += 1
                continue
            if event.kind is EventKind.STORE:
                self.nodes[event.pool].add(event.node)
                changed = index.add(event.entry, event.key, event.node, event.parent, event.length)
            else:
                changed = index.remove(event.entry, event.key, event.parent, event.length)
            self.counts[f"events_{event.kind}" if changed else f"events_{event.kind}_stale"] += 1

    def forget(self, pool: str) -> None:
        """The pool is gone (with its node's process): it starts over empty."""
        self.indexes[pool] = PrefixIndex(self.needs_snapshot)
        self.nodes[pool] = set()

    def drop(self, pool: str) -> None:
        """The pool is gone for good (its node changed role under a new name)."""
        self.indexes.pop(pool, None)
        self.nodes.pop(pool, None)

    def match(self, prompt: PromptKeys, limit: int | None = None) -> dict[str, PoolMatch]:
        out = {}
        for name, index in self.indexes.items():
            m = index.match(prompt, limit)
            node_hits = {}
            if m.hit_tokens:  # a node that holds every entry has the pool's hit: no second walk
                node_hits = {
                    node: m.hit_tokens if index.holds_all(node) else index.match(prompt, limit, node).hit_tokens
                    for node in sorted(self.nodes[name])
                }
            kv = min(m.kv_tokens(prompt.block_size), prompt.num_tokens if limit is None else max(limit, 0))
            out[name] = PoolMatch(name, m.hit_tokens, kv, node_hits)
            self.counts[f"{name}_lookups"] += 1
            self.counts[f"{name}_hit_tokens"] += m.hit_tokens
        self.counts["lookup_tokens"] += prompt.num_tokens
        return out


Prompt = Sequence[int] | PromptKeys | None  # token ids, or their keys from ``PrefixDirectory.keys`` (None: no match)


class PrefixDirectory(GlobalCacheManager):
    """The gateway's view: one pool per prefill and decode node, looked up by a prompt's tokens or keys."""

    def __init__(
        self, enabled: bool, block_size: int, namespace: str, needs_snapshot: bool, nodes: Iterable[str]
    ) -> None:
        super().__init__(nodes, needs_snapshot)
        self.enabled, self.block_size, self.namespace = enabled, block_size, namespace

    def keys(self, prompt_ids: Sequence[int]) -> PromptKeys | None:
        """The prompt's block keys, hashed once per request and passed to each lookup below; None when nothing
        can match (the cache is off, or the prompt has one token)."""
        if not self.enabled or len(prompt_ids) < 2:
            return None
        return PromptKeys.from_tokens(prompt_ids, self.block_size, self.namespace)

    def matches(self, prompt: Prompt) -> dict[str, PoolMatch]:
        """Each node's match for the prompt, leaving at least one token to compute."""
        keys = prompt if prompt is None or isinstance(prompt, PromptKeys) else self.keys(prompt)
        return {} if keys is None else self.match(keys, limit=keys.num_tokens - 1)

    def node_hits(self, prompt: Prompt) -> dict[str, int]:
        """Each node's usable hit for the prompt."""
        return {node: m.hit_tokens for node, m in self.matches(prompt).items()}

    def seen_prefix(self, prompt: Prompt) -> int:
        """The longest prefix of the prompt whose KV blocks any node stored: a branch point another prompt
        shared, where a state snapshot is worth taking (``cache.snapshot_policy``)."""
        return max((m.kv_prefix_tokens for m in self.matches(prompt).values()), default=0)
