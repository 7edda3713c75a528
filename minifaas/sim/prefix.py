"""The clusters' prefix caches in the simulator: the live pool (filled a whole prompt at a time) and the live global
manager, sizes only, and the router's view of a cluster from the manager's match.

One pool per cluster, its entries held under the cluster's name, so no node has a private hit and the router's
node choice stays load-driven. The manager reads each pool's own index rather than mirroring it from events.
A PrfaaS prompt's KV that lands in the PD cluster is kept there (its blocks and end state, not the intermediate
snapshots), so a conversation's next turn ships only its increment.
"""

from __future__ import annotations

from collections.abc import Callable

from minifaas.cache.pool import Entry, HybridPrefixPool
from minifaas.cache.pool_config import PoolConfig
from minifaas.cache.prefix_index import BlockKey, EntryKind, GlobalCacheManager, PoolMatch, PromptKeys
from minifaas.planner.profile import PrefillProfile
from minifaas.policy.plugin import Args
from minifaas.policy.router import ClusterView, NodeView

UNLIMITED_BYTES = 2**62


class SizedPool(HybridPrefixPool[None]):
    """A pool of sizes without payloads, which stores what a prefill leaves a whole prompt at a time."""

    def put_blocks(
        self, prompt: PromptKeys, start: int, end: int, now: float, nbytes: int, node: str | None = None
    ) -> int:
        """``put_block`` for full blocks [start, end) in order; stops at the first one that cannot be stored,
        since every later one would be an orphan. Returns how many are in the pool afterwards."""
        holder = self.node if node is None else node
        if not (self.config.enabled and self.index.holds_all(holder)):
            for j in range(start, end):
                if not self.put_block(prompt, j, now, nbytes, node=node):
                    return j - start
            return end - start
        # A replayed conversation finds most of its blocks here, all of them the holder's, so
        # put_block would only touch them: find that leading run at once and touch it. Every block
        # after it is missing too (the pool is prefix-closed), so each is stored under the one
        # before it without a lookup, unless it needs room made (eviction: the general path).
        present = self.index.leading_blocks(prompt, start, end)
        self.counts["block_store_dups"] += present
        keys = prompt.block_keys
        self._touch_blocks(keys[start : start + present])
        first_new = start + present
        parent = self.entry(EntryKind.BLOCK, keys[first_new - 1]) if first_new else None
        for j in range(first_new, end):
            if (parent is None and j) or self.free_bytes < nbytes:
                if not self.put_block(prompt, j, now, nbytes, node=node):
                    return j - start
                parent = self.entry(EntryKind.BLOCK, keys[j])
            else:
                parent_key = keys[j - 1] if j else prompt.root
                entry = Entry(EntryKind.BLOCK, keys[j], parent_key, (j + 1) * prompt.block_size, nbytes, None)
                parent = self._insert(entry, parent, now, holder)
        return end - start

    def store_prompt(
        self,
        prompt: PromptKeys,
        now: float,
        block_nbytes: int,
        snapshot_nbytes: Callable[[int], int],
        start: int = 0,
        node: str | None = None,
        seen_tokens: int = 0,
    ) -> None:
        """Store everything a prefill of tokens [start, end) leaves behind; ``seen_tokens``: the prompt's branch
        point when its prefill began (``snapshot_points``)."""
        self.put_blocks(prompt, start // prompt.block_size, prompt.num_full_blocks, now, block_nbytes, node)
        for n in self.snapshot_points(start, prompt.num_tokens, seen_tokens):
            if prompt.key_at(n) is not None:
                self.put_snapshot(prompt, n, now, snapshot_nbytes(n), node=node)
        self.touch(prompt, prompt.num_tokens)


def cluster_view(match: PoolMatch, prefill: tuple[NodeView, ...], decode: tuple[NodeView, ...] = ()) -> ClusterView:
    """The router's view of the cluster a pool serves: nodes keep their load and health, hits come from the match."""
    nodes = tuple(NodeView(n.node_id, match.node_hits.get(n.node_id, 0), n.load, n.healthy) for n in prefill)
    return ClusterView(match.pool, nodes, decode, match.kv_prefix_tokens, match.hit_tokens)


class ClusterPrefixCaches:
    def __init__(
        self,
        clusters: tuple[str, ...],
        block_tokens: int,
        capacity_bytes: float,
        kv_profile: PrefillProfile,
        snapshot_interval_blocks: int = 8,
        snapshot_policy: str = "interval",
        snapshot_args: Args = (),
    ) -> None:
        capacity = UNLIMITED_BYTES if capacity_bytes == float("inf") else int(capacity_bytes)
        self.block_tokens = block_tokens
        configs = {
            name: PoolConfig(name, capacity, block_tokens, snapshot_interval_blocks, events=False,
                             snapshot_policy=snapshot_policy, snapshot_args=snapshot_args)
            for name in clusters
        }  # fmt: skip
        self.pools: dict[str, SizedPool] = {name: SizedPool(c, name) for name, c in configs.items()}
        self.manager = GlobalCacheManager(clusters)
        for name, pool in self.pools.items():  # each pool's own index, held by the cluster alone: no mirror
            self.manager.indexes[name], self.manager.nodes[name] = pool.index, {name}
        fixed = float(kv_profile.kv_bytes(0))
        self._block_bytes = max(1, round(float(kv_profile.kv_bytes(block_tokens)) - fixed))
        self._snapshot_bytes = max(1, round(fixed))
        self._root = bytes(8)  # key 0; every other key is the number of a distinct prefix
        self._children: dict[bytes, dict[int | tuple[int, int], bytes]] = {}  # parent key -> step -> key
        self._named = 0
        self._prefilled_ends: dict[str, set[BlockKey]] = {name: set() for name in clusters}  # ends with their logits

    def keys(self, hash_ids: tuple[int, ...], prompt_tokens: int) -> PromptKeys:
        """The prompt's block keys from one trace id per block, numbered rather than hashed: keys are equal exactly
        when the prefixes are."""
        size = self.block_tokens
        full, tail = divmod(prompt_tokens, size)
        if len(hash_ids) != full + (tail > 0):
            raise ValueError(f"{prompt_tokens} tokens need {full + (tail > 0)} block ids, got {len(hash_ids)}")
        keys: list[bytes] = []
        parent = self._root
        for block_id in hash_ids[:full]:
            parent = self._child(parent, block_id)
            keys.append(parent)
        end = self._child(parent, (hash_ids[full], tail)) if tail else parent  # a partial block: its length too
        return PromptKeys(self._root, size, prompt_tokens, tuple(keys), end)

    def _child(self, parent: bytes, step: int | tuple[int, int]) -> bytes:
        children = self._children.get(parent)
        if children is None:
            children = self._children[parent] = {}
        key = children.get(step)
        if key is None:
            self._named += 1
            key = children[step] = self._named.to_bytes(8, "little")
        return key

    def match(self, keys: PromptKeys) -> dict[str, PoolMatch]:
        """Per cluster: the usable hit and the KV prefix present; at least one token is left to compute."""
        return self.manager.match(keys, limit=keys.num_tokens - 1)

    def holds_whole(self, cluster: str, keys: PromptKeys) -> bool:
        """The cluster's pool holds the state at the prompt's very end, kept by a prefill there (with the
        logits of the token after it; a state moved in has none): the whole prompt is a hit there."""
        end = keys.end_key
        return end in self._prefilled_ends[cluster] and self.pools[cluster].entry(EntryKind.SNAPSHOT, end) is not None

    def store(self, cluster: str, keys: PromptKeys, now: float, seen_tokens: int = 0) -> None:
        """What a prefill leaves; ``seen_tokens``: the longest prefix any pool held as it was routed (the
        gateway's ``seen_prefix``), where the ``reuse`` snapshot policy keeps a branch point."""
        self.pools[cluster].store_prompt(
            keys, now, self._block_bytes, lambda _: self._snapshot_bytes, seen_tokens=seen_tokens
        )
        self._prefilled_ends[cluster].add(keys.end_key)

    def store_received(self, cluster: str, keys: PromptKeys, now: float) -> None:
        pool = self.pools[cluster]
        blocks = keys.num_full_blocks
        # the end state hangs from the last block; without it the snapshot would be an orphan
        if pool.put_blocks(keys, 0, blocks, now, self._block_bytes) == blocks:
            pool.put_snapshot(keys, keys.num_tokens, now, self._snapshot_bytes)
