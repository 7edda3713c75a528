"""The global KV cache manager: the gateway's view of every prefix pool.

It holds no state bytes, only a mirror of each pool's index, kept current by the pools' store/evict
events (``apply``; a pool's ``inventory`` brings a new manager up to date). ``match`` gives a prompt's usable hit
per pool and per node, and ``PoolMatch.view`` turns it into the router's input:

    manager.apply_all(events_from_pools)
    matches = manager.match(PromptKeys.from_tokens(tokens, block_size, model), limit=len(tokens) - 1)
    pd = matches["pd"].view(pd_prefill_nodes, pd_decode_nodes)

A pool is one node's live (each prefill node keeps its own) and one cluster's in the simulator. A node "holds" an
entry when it stored it (it computed that prefix, so its own memory likely still has it); every node that loads from
a pool can use anything in it, so a node hit only breaks ties between equally busy nodes. Events may arrive late:
the answer is a forecast. Sans-IO, like the pool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from minifaas.cache.block_hash import PromptKeys
from minifaas.cache.events import CacheEvent, EventKind
from minifaas.cache.prefix_index import PrefixIndex
from minifaas.policy.router import ClusterView, NodeView


@dataclass(frozen=True, slots=True)
class PoolMatch:
    pool: str
    hit_tokens: int  # usable from the pool, by any node that can load from it
    kv_prefix_tokens: int  # full-attention KV present (snapshot or not): what need not be resent
    node_hits: dict[str, int] = field(default_factory=dict)  # usable over each node's own entries

    def view(self, prefill_nodes: Sequence[NodeView] = (), decode_nodes: Sequence[NodeView] = ()) -> ClusterView:
        """The router's view of the cluster this pool serves: nodes keep their load and health, hits come from here."""
        hits = self.node_hits
        nodes = tuple(NodeView(n.node_id, hits.get(n.node_id, 0), n.load, n.healthy) for n in prefill_nodes)
        return ClusterView(self.pool, nodes, tuple(decode_nodes), self.kv_prefix_tokens, self.hit_tokens)


class GlobalCacheManager:
    def __init__(self, pools: Iterable[str], needs_snapshot: bool = True) -> None:
        self.indexes = {name: PrefixIndex(needs_snapshot) for name in pools}
        self.nodes: dict[str, set[str]] = {name: set() for name in self.indexes}
        self.counts: Counter[str] = Counter()

    def attach(self, pool: str, index: PrefixIndex, node: str) -> None:
        """Match ``pool`` against its own index, held by ``node`` alone: what replaying the pool's
        events at once would build, without the events (a pool in this process: the simulator)."""
        self.indexes[pool] = index
        self.nodes[pool] = {node}

    def apply(self, event: CacheEvent) -> None:
        index = self.indexes.get(event.pool)
        if index is None:
            self.counts["events_unknown_cluster"] += 1
            return
        if event.kind is EventKind.STORE:
            self.nodes[event.pool].add(event.node)
            changed = index.add(event.entry, event.key, event.node, event.parent, event.length)
        else:
            changed = index.remove(event.entry, event.key, event.parent, event.length)
        self.counts[f"events_{event.kind}" if changed else f"events_{event.kind}_stale"] += 1

    def apply_all(self, events: Iterable[CacheEvent]) -> None:
        for event in events:
            self.apply(event)

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
