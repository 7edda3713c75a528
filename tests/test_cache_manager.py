from __future__ import annotations

import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from minifaas.cache.pool_config import PoolConfig
from minifaas.cache.prefix_index import EventKind, GlobalCacheManager, PrefixIndex, PromptKeys
from minifaas.control.worker_ops import CACHE_EVENTS, REPLIES, CacheEvents, WireEvent, from_wire
from minifaas.policy.router import CacheMove, NodeView, Path, RouteInput, Router, RouteReason, Rule
from minifaas.sim.prefix import SizedPool, cluster_view

B = 8


def keys(tokens: list[int]) -> PromptKeys:
    return PromptKeys.from_tokens(tokens, B, "test-model")


def pools(capacity: int = 10**9, interval: int = 1) -> dict[str, SizedPool]:
    return {c: SizedPool(PoolConfig(c, capacity, B, interval)) for c in ("prfaas", "pd")}


def prefill(pool: SizedPool, tokens: list[int], node: str, now: float) -> None:
    k = keys(tokens)
    lease = pool.acquire(k, limit=len(tokens) - 1)
    pool.release(lease)
    pool.store_prompt(k, now, block_nbytes=10, snapshot_nbytes=lambda n: 30, start=lease.hit_tokens, node=node)


@settings(max_examples=80, deadline=None)
@given(
    seeds=st.lists(st.tuples(st.sampled_from(["prfaas", "pd"]), st.integers(0, 3), st.integers(0, 10**6)), max_size=40),
    capacity=st.integers(40, 800),
    interval=st.integers(0, 2),
)
def test_manager_mirrors_every_pool_through_events(
    seeds: list[tuple[str, int, int]], capacity: int, interval: int
) -> None:
    ps = pools(capacity, interval)
    manager = GlobalCacheManager(ps)
    rng = random.Random(0)
    prompts = []
    storers: dict[str, set[str]] = {c: set() for c in ps}
    for t, (cluster, node, seed) in enumerate(seeds):
        rng.seed(seed)
        tokens = [rng.randrange(2) for _ in range(rng.randrange(2, 40))]
        prompts.append(tokens)
        prefill(ps[cluster], tokens, f"{cluster}-{node}", float(t))
        events = ps[cluster].drain_events()
        storers[cluster].update(e.node for e in events if e.kind is EventKind.STORE)
        manager.apply(events)
        for tokens in prompts[-5:]:
            k, limit = keys(tokens), len(tokens) - 1
            got = manager.match(k, limit)
            for name, pool in ps.items():
                m = pool.match(k, limit)
                assert got[name].hit_tokens == m.hit_tokens
                assert got[name].kv_prefix_tokens == min(m.kv_tokens(B), limit)
                assert set(got[name].node_hits) == (storers[name] if m.hit_tokens else set())
                for node_id, hit in got[name].node_hits.items():
                    assert hit == pool.index.match(k, limit, node_id).hit_tokens <= m.hit_tokens
    fresh = GlobalCacheManager(ps)
    for pool in ps.values():
        fresh.apply(pool.inventory(now=1e9))
    assert all(fresh.indexes[c].blocks == manager.indexes[c].blocks for c in ps)
    assert all(fresh.indexes[c].snapshots == manager.indexes[c].snapshots for c in ps)


def test_pool_events_drive_the_router_end_to_end() -> None:
    ps = pools()
    manager = GlobalCacheManager(ps)
    system = list(range(1000, 1100))  # a 100-token shared system prompt
    prefill(ps["pd"], [*system, 1, 2, 3], node="p1", now=0.0)
    prefill(ps["prfaas"], [*system, 1, 2, 3, *range(40)], node="x0", now=1.0)
    for pool in ps.values():
        manager.apply(pool.drain_events())
    prompt = [*system, 1, 2, 3, *range(40), 77, 78]
    matches = manager.match(keys(prompt), limit=len(prompt) - 1)
    assert (matches["pd"].hit_tokens, matches["prfaas"].hit_tokens) == (103, 143)
    assert matches["pd"].node_hits == {"p1": 103}

    pd_nodes = (NodeView("p0"), NodeView("p1"))
    decode = (NodeView("d0"),)
    pd, prfaas = (
        cluster_view(matches["pd"], pd_nodes, decode),
        cluster_view(matches["prfaas"], (NodeView("x0"), NodeView("x1"))),
    )
    router = Router()
    scarce = router.route(RouteInput(len(prompt), 30, Rule.SCARCE, prfaas, pd))
    assert (scarce.path, scarce.prefill_node, scarce.cached_tokens) == (Path.PRFAAS, "x0", 143)
    assert scarce.link_kv_start == 103  # the PD side already holds the system prompt's KV and more
    abundant = router.route(RouteInput(len(prompt), 30, Rule.ABUNDANT, prfaas, pd))
    assert (abundant.path, abundant.reason) == (Path.PD, RouteReason.SHORT_AFTER_CACHE_MOVE)
    assert abundant.cache_move == CacheMove("prfaas", "pd", 103, 143)
    assert (abundant.prefill_node, abundant.cached_tokens) == ("p1", 143)  # p1 holds part of it itself


def test_stale_and_foreign_events_are_counted_not_applied() -> None:
    ps = pools(capacity=2 * 40)
    manager = GlobalCacheManager(["pd"])
    prefill(ps["pd"], list(range(8)), node="p0", now=0.0)
    events = ps["pd"].drain_events()
    manager.apply(events)
    manager.apply(events)  # delivered twice
    prefill(ps["prfaas"], list(range(8)), node="x0", now=0.0)
    manager.apply(ps["prfaas"].drain_events())
    assert manager.counts["events_store"] == 2 and manager.counts["events_store_stale"] == 2
    assert manager.counts["events_unknown_cluster"] == 2
    prefill(ps["pd"], list(range(50, 58)), node="p0", now=1.0)
    prefill(ps["pd"], list(range(60, 68)), node="p1", now=2.0)
    manager.apply(ps["pd"].drain_events())
    assert manager.counts["events_evict"] == 2
    assert manager.match(keys(list(range(8))))["pd"].hit_tokens == 0


def forget(index: PrefixIndex, node: str) -> None:
    """``node`` holds nothing any more; the entries stay (other nodes may load them)."""
    for table in (index.blocks, index.snapshots):
        for holders in table.values():
            holders.discard(node)
    index._held_by.pop(node, None)


def test_a_node_that_leaves_holds_nothing_but_the_pool_keeps_its_prefixes() -> None:
    ps = pools()
    manager = GlobalCacheManager(ps)
    tokens = list(range(30))
    prefill(ps["pd"], tokens, node="p0", now=0.0)
    manager.apply(ps["pd"].drain_events())
    assert manager.match(keys(tokens))["pd"].node_hits == {"p0": 30}
    manager.nodes["pd"].discard("p0")  # p0 left: it holds nothing locally any more (the pool still may)
    forget(manager.indexes["pd"], "p0")
    after = manager.match(keys(tokens))["pd"]
    assert after.hit_tokens == 30 and after.node_hits == {}


def test_events_survive_a_json_round_trip() -> None:
    ps = pools()
    prefill(ps["pd"], list(range(20)), node="p0", now=3.5)
    events = ps["pd"].drain_events()
    sent = msgspec.json.encode(CacheEvents(req=CACHE_EVENTS, events=[WireEvent.of(e) for e in events]))
    got = from_wire(msgspec.json.decode(sent), REPLIES)
    assert events and isinstance(got, CacheEvents) and [e.event() for e in got.events] == events
