"""The clusters' prefix caches in the simulator: the live hybrid pool, one per cluster, sizes only.

Each cluster keeps one ``HybridPrefixPool`` (minifaas.cache), shared by its
nodes, so a hit is the cluster's ``pool_hit_tokens`` for the router. Trace
hash ids become block keys with ``PromptKeys.from_ids``; a prefill stores what
it computed with ``store_prompt`` (no payloads). The decode side of the PD
cluster stores a prompt when its KV lands there, which is what lets the next
turn of a conversation ship only its increment.
"""

from __future__ import annotations

from dataclasses import dataclass

from minifaas.cache.block_hash import PromptKeys
from minifaas.cache.pool import HybridPrefixPool, PoolConfig
from minifaas.planner.profile import PrefillProfile

UNLIMITED_BYTES = 2**62


@dataclass(frozen=True, slots=True)
class Hits:
    prfaas_hit: int  # usable prefix (blocks and a state snapshot) in the PrfaaS pool
    prfaas_kv: int  # full-attention KV prefix present there
    pd_hit: int
    pd_kv: int


class ClusterPrefixCaches:
    def __init__(
        self, block_tokens: int, capacity_bytes: float, kv_profile: PrefillProfile, snapshot_interval_blocks: int = 8
    ) -> None:
        capacity = UNLIMITED_BYTES if capacity_bytes == float("inf") else int(capacity_bytes)
        self.block_tokens = block_tokens
        self.pools: dict[str, HybridPrefixPool[None]] = {
            name: HybridPrefixPool(PoolConfig(name, capacity, block_tokens, snapshot_interval_blocks), node=name)
            for name in ("prfaas", "pd-p")
        }
        fixed = float(kv_profile.kv_bytes(0))
        self._block_bytes = max(1, round(float(kv_profile.kv_bytes(block_tokens)) - fixed))
        self._snapshot_bytes = max(1, round(fixed))

    def keys(self, hash_ids: tuple[int, ...], prompt_tokens: int) -> PromptKeys:
        return PromptKeys.from_ids(hash_ids, prompt_tokens, self.block_tokens)

    def lookup(self, hash_ids: tuple[int, ...], prompt_tokens: int) -> Hits:
        keys = self.keys(hash_ids, prompt_tokens)
        limit = prompt_tokens - 1  # at least one token is computed, to produce the first logits
        prfaas = self.pools["prfaas"].match(keys, limit)
        pd = self.pools["pd-p"].match(keys, limit)
        return Hits(
            prfaas.hit_tokens,
            min(prfaas.kv_tokens(self.block_tokens), prompt_tokens),
            pd.hit_tokens,
            min(pd.kv_tokens(self.block_tokens), prompt_tokens),
        )

    def store(self, cluster: str, hash_ids: tuple[int, ...], prompt_tokens: int, now: float) -> None:
        pool = self.pools[cluster]
        pool.store_prompt(self.keys(hash_ids, prompt_tokens), now, self._block_bytes, lambda _: self._snapshot_bytes)
        pool.drain_events()  # the simulator has no global manager process to ship them to
