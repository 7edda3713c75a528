"""The gateway's prefix directory, fed by real pools' events (no processes, no model)."""

from __future__ import annotations

import msgspec

from minifaas.cache.pool_config import PoolConfig
from minifaas.cache.prefix_index import CacheEvent, PrefixDirectory, PromptKeys
from minifaas.config import CacheConfig
from minifaas.control.worker_ops import WireEvent
from minifaas.sim.prefix import SizedPool

BLOCK = 8
TOKENS = list(range(50))


def _events(node: str, tokens: list[int], snapshots: bool = True) -> list[CacheEvent]:
    pool = SizedPool(PoolConfig(node, 1 << 20, BLOCK, 2), node)
    keys = PromptKeys.from_tokens(tokens, BLOCK, "m")
    if snapshots:
        pool.store_prompt(keys, 0.0, 100, lambda n: 10)
    else:  # a decode node keeps blocks only
        for j in range(keys.num_full_blocks):
            pool.put_block(keys, j, 0.0, 100)
    sent = [msgspec.json.encode(WireEvent.of(e)) for e in pool.drain_events()]
    return [msgspec.json.decode(e, type=WireEvent).event() for e in sent]  # as they arrive at the gateway


def _directory(config: CacheConfig, nodes: list[str]) -> PrefixDirectory:
    return PrefixDirectory(config.enabled, config.block_size, "m", True, nodes)


def kv_prefix(directory: PrefixDirectory, prompt: list[int], node: str, config: CacheConfig) -> int:
    """Full-attention KV of the prompt's prefix that ``node`` holds (a decode node needs no snapshot), as an
    incremental transfer to it would skip."""
    found = directory.matches(prompt) if config.incremental_transfer else {}
    return found[node].kv_prefix_tokens if found else 0


def test_hits_per_node_kv_prefix_of_a_decode_node_and_forgetting_a_node() -> None:
    config = CacheConfig(block_size=BLOCK)
    directory = _directory(config, ["p0", "p1", "d0"])
    directory.apply(_events("p0", TOKENS))
    directory.apply(_events("d0", TOKENS, snapshots=False))
    longer = [*TOKENS, 99, 98, 97]
    assert directory.node_hits(longer) == {"p0": 50, "p1": 0, "d0": 0}  # the end snapshot at 50
    assert directory.node_hits(TOKENS)["p0"] == 48  # at least one token is computed: snapshot at 3 * 16
    assert kv_prefix(directory, longer, "d0", config) == 48 and kv_prefix(directory, longer, "p1", config) == 0
    directory.forget("p0")
    assert directory.node_hits(longer)["p0"] == 0
    directory.apply(_events("p0", TOKENS))  # a restarted node's new stores count again
    assert directory.node_hits(longer)["p0"] == 50


def test_off_switches_answer_nothing() -> None:
    configs = CacheConfig(mode="none", block_size=BLOCK), CacheConfig(block_size=BLOCK, incremental_transfer=False)
    none, full = (_directory(config, ["p0", "d0"]) for config in configs)
    for directory, config in zip((none, full), configs, strict=True):
        directory.apply(_events("p0", TOKENS))
        directory.apply(_events("d0", TOKENS, snapshots=False))
        assert kv_prefix(directory, [*TOKENS, 1], "d0", config) == 0
    assert none.node_hits([*TOKENS, 1]) == {} and full.node_hits([*TOKENS, 1])["p0"] == 50
