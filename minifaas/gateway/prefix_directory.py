"""Where every cached prefix lives, as the gateway sees it, turned into the router's per-node hits.

One mirror per prefill node's pool, and per decode node's received KV, fed by the events the nodes send with
their replies. The answer is a forecast: the request records what the node's pool really held.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from minifaas.cache.block_hash import PromptKeys
from minifaas.cache.prefix_index import CacheEvent, GlobalCacheManager, PoolMatch, PrefixIndex
from minifaas.config import CacheConfig
from minifaas.control.worker_ops import CACHE_EVENTS, CacheEvents
from minifaas.gateway.worker_handle import Lost, WorkerHandle


class Closing(Protocol):
    closing: bool  # shutdown has begun (``Workers``)


Prompt = Sequence[int] | PromptKeys | None  # token ids, or their keys from ``PrefixDirectory.keys`` (None: no match)


class PrefixDirectory:
    def __init__(self, config: CacheConfig, namespace: str, needs_snapshot: bool, nodes: Iterable[str]) -> None:
        self.config, self.namespace, self.needs_snapshot = config, namespace, needs_snapshot
        self.enabled, self.block_size = config.enabled, config.block_size
        self.manager = GlobalCacheManager(nodes, needs_snapshot)

    def apply(self, events: Iterable[CacheEvent]) -> None:
        self.manager.apply_all(events)

    async def follow(self, w: WorkerHandle, pool: Closing) -> None:
        """Keep the worker's mirror current with its pool, through restarts, until it is retired or shutdown."""
        inbox = w.inboxes[CACHE_EVENTS]
        while not pool.closing:
            msg = await inbox.get()
            if isinstance(msg, CacheEvents):
                self.apply(msg.events)
            elif isinstance(msg, Lost) and w.retired:
                self.drop(w.name)
                return
            elif isinstance(msg, Lost):
                self.forget(w.name)  # a re-attached worker sends its inventory again

    def forget(self, node: str) -> None:
        """The node's process is gone, and its pool with it."""
        self.manager.indexes[node] = PrefixIndex(self.needs_snapshot)
        self.manager.nodes[node] = set()

    def drop(self, node: str) -> None:
        """The node is gone for good (it changed role under a new name)."""
        self.manager.indexes.pop(node, None)
        self.manager.nodes.pop(node, None)

    def keys(self, prompt_ids: Sequence[int]) -> PromptKeys | None:
        """The prompt's block keys, hashed once per request and passed to each lookup below; None when nothing
        can match (the cache is off, or the prompt has one token)."""
        if not self.enabled or len(prompt_ids) < 2:
            return None
        return PromptKeys.from_tokens(prompt_ids, self.block_size, self.namespace)

    def matches(self, prompt: Prompt) -> dict[str, PoolMatch]:
        """Each node's match for the prompt, leaving at least one token to compute."""
        keys = prompt if prompt is None or isinstance(prompt, PromptKeys) else self.keys(prompt)
        return {} if keys is None else self.manager.match(keys, limit=keys.num_tokens - 1)

    def node_hits(self, prompt: Prompt) -> dict[str, int]:
        """Each node's usable hit for the prompt."""
        return {node: m.hit_tokens for node, m in self.matches(prompt).items()}

    def seen_prefix(self, prompt: Prompt) -> int:
        """The longest prefix of the prompt whose KV blocks any node stored: a branch point another prompt
        shared, where a state snapshot is worth taking (``cache.snapshot_policy``)."""
        return max((m.kv_prefix_tokens for m in self.matches(prompt).values()), default=0)
