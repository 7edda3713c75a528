from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minifaas.policy.router import (
    CacheMove,
    ClusterView,
    NodeView,
    Path,
    RouteDecision,
    RouteInput,
    Router,
    RouterConfig,
    RouteReason,
    Rule,
    decide,
)

T = 1000  # threshold in tokens


def clusters(
    pd_hits: tuple[int, ...] = (0, 0),
    prfaas_hits: tuple[int, ...] = (0, 0),
    pd_kv: int = 0,
    prfaas_kv: int = 0,
) -> tuple[ClusterView, ClusterView]:
    prfaas = ClusterView("prfaas", tuple(NodeView(f"x{i}", h) for i, h in enumerate(prfaas_hits)), (), prfaas_kv)
    pd = ClusterView(
        "pd",
        tuple(NodeView(f"p{i}", h) for i, h in enumerate(pd_hits)),
        (NodeView("d0", load=3), NodeView("d1", load=1)),
        pd_kv,
    )
    return prfaas, pd


def route(
    prompt: int,
    rule: Rule = Rule.SCARCE,
    config: RouterConfig | None = None,
    link_up: bool = True,
    **hits: int | tuple[int, ...],
) -> RouteDecision:
    prfaas, pd = clusters(**hits)  # type: ignore[arg-type]
    return decide(RouteInput(prompt, T, rule, prfaas, pd, link_up), config or RouterConfig())


def test_threshold_boundary_without_cache() -> None:
    at = route(T)
    assert (at.path, at.reason, at.cached_tokens) == (Path.PD, RouteReason.SHORT, 0)
    above = route(T + 1)
    assert (above.path, above.reason, above.incremental_tokens) == (Path.PRFAAS, RouteReason.LONG, T + 1)
    assert above.decode_node == "d1"  # least-loaded decode node


def test_scarce_rule_judges_pd_by_its_own_cache() -> None:
    local = route(3000, pd_hits=(2000, 0))
    assert (local.path, local.reason, local.prefill_node, local.cached_tokens) == (
        Path.PD,
        RouteReason.SHORT_AFTER_CACHE,
        "p0",
        2000,
    )
    # a PrfaaS-side hit does not make the request short under SCARCE; it is offloaded and used there
    remote = route(3000, prfaas_hits=(0, 2500))
    assert (remote.path, remote.prefill_node, remote.cached_tokens, remote.cache_move) == (
        Path.PRFAAS,
        "x1",
        2500,
        None,
    )


def test_abundant_rule_moves_the_longer_prfaas_cache_to_pd() -> None:
    d = route(3000, Rule.ABUNDANT, prfaas_hits=(2500, 0), pd_hits=(512, 0), pd_kv=1024)
    assert (d.path, d.reason) == (Path.PD, RouteReason.SHORT_AFTER_CACHE_MOVE)
    assert d.cache_move == CacheMove("prfaas", "pd", 1024, 2500)  # PD already holds KV up to 1024
    assert d.cached_tokens == 2500 and d.incremental_tokens == 500


def test_abundant_rule_moves_the_longer_pd_cache_to_prfaas_for_a_long_request() -> None:
    d = route(8000, Rule.ABUNDANT, pd_hits=(4000, 0), prfaas_hits=(1000, 0), prfaas_kv=1536, pd_kv=4096)
    assert (d.path, d.reason) == (Path.PRFAAS, RouteReason.LONG)
    assert d.cache_move == CacheMove("pd", "prfaas", 1536, 4000)
    assert d.cached_tokens == 4000
    assert d.link_kv_start == 4096  # decode side loads its own prefix KV; only the rest crosses


def test_abundant_without_cache_move_judges_like_scarce() -> None:
    off = RouterConfig(cross_cluster_cache_move=False)
    d = route(3000, Rule.ABUNDANT, off, prfaas_hits=(2500, 0))
    assert (d.path, d.cache_move, d.cached_tokens) == (Path.PRFAAS, None, 2500)
    down = route(3000, Rule.ABUNDANT, prfaas_hits=(2500, 0), link_up=False)
    assert (down.path, down.reason, down.cache_move) == (Path.PD, RouteReason.LONG_BUT_PRFAAS_DOWN, None)


def test_incremental_transfer_off_ships_the_whole_prompt() -> None:
    on = route(5000, pd_kv=2048)
    off = route(5000, config=RouterConfig(incremental_transfer=False), pd_kv=2048)
    assert on.link_kv_start == 2048 and off.link_kv_start == 0
    assert route(500, pd_kv=500).link_kv_start == 0  # PD path: nothing crosses the link


def test_node_choice_is_cache_affine_but_load_aware() -> None:
    pd = ClusterView(
        "pd", (NodeView("a", hit_tokens=0, load=0), NodeView("b", hit_tokens=1500, load=200)), (NodeView("d"),)
    )
    prfaas = ClusterView("prfaas")
    req = RouteInput(2000, T, Rule.SCARCE, prfaas, pd)
    assert decide(req).prefill_node == "b"  # 200 + 500 queued tokens beat 0 + 2000
    busy = dataclasses.replace(pd, prefill_nodes=(pd.prefill_nodes[0], NodeView("b", 1500, load=1800)))
    req = RouteInput(2000, T, Rule.SCARCE, prfaas, busy)
    # PD's hit still makes it short, but node b's queue makes a would-be finish later than a's
    assert (decide(req).prefill_node, decide(req).cached_tokens) == ("a", 0)
    blind = decide(RouteInput(2000, T, Rule.SCARCE, prfaas, pd), RouterConfig(cache_affinity=False))
    assert blind.prefill_node == "a"


def test_a_shared_pool_hit_is_loadable_by_every_node_and_holders_win_ties() -> None:
    nodes = (NodeView("a", hit_tokens=0), NodeView("b", hit_tokens=1024), NodeView("c", hit_tokens=0, load=10))
    pd = ClusterView("pd", nodes, (NodeView("d"),), kv_prefix_tokens=1536, pool_hit_tokens=1536)
    d = decide(RouteInput(2000, T, Rule.SCARCE, ClusterView("prfaas"), pd))
    assert (d.path, d.reason, d.cached_tokens) == (Path.PD, RouteReason.SHORT_AFTER_CACHE, 1536)
    assert d.prefill_node == "b"  # same work everywhere; b holds part of the prefix itself
    busy_b = dataclasses.replace(pd, prefill_nodes=(nodes[0], NodeView("b", 1024, load=1), nodes[2]))
    assert decide(RouteInput(2000, T, Rule.SCARCE, ClusterView("prfaas"), busy_b)).prefill_node == "a"


def test_unhealthy_nodes_and_fallbacks() -> None:
    prfaas, pd = clusters()
    sick_prfaas = dataclasses.replace(
        prfaas, prefill_nodes=tuple(NodeView(n.node_id, healthy=False) for n in prfaas.prefill_nodes)
    )
    d = decide(RouteInput(5000, T, Rule.SCARCE, sick_prfaas, pd))
    assert (d.path, d.reason) == (Path.PD, RouteReason.LONG_BUT_PRFAAS_DOWN)
    sick_pd = dataclasses.replace(pd, prefill_nodes=(NodeView("p0", healthy=False),))
    d = decide(RouteInput(100, T, Rule.SCARCE, prfaas, sick_pd))
    assert (d.path, d.reason) == (Path.PRFAAS, RouteReason.SHORT_BUT_PD_PREFILL_DOWN)
    d = decide(RouteInput(100, T, Rule.SCARCE, prfaas, sick_pd, link_up=False))
    assert (d.path, d.reason, d.prefill_node) == (Path.REJECT, RouteReason.NO_PREFILL_NODE, None)
    no_decode = dataclasses.replace(pd, decode_nodes=(NodeView("d0", healthy=False),))
    assert decide(RouteInput(100, T, Rule.SCARCE, prfaas, no_decode)).reason is RouteReason.NO_DECODE_NODE


def test_inputs_are_validated() -> None:
    prfaas, pd = clusters(pd_hits=(600,))
    with pytest.raises(ValueError):
        RouteInput(500, T, Rule.SCARCE, prfaas, pd)  # hit longer than the prompt
    with pytest.raises(ValueError):
        RouteInput(500, -1, Rule.SCARCE, prfaas, pd)
    with pytest.raises(ValueError):
        NodeView("n", load=-1)


def test_router_counts_every_decision() -> None:
    router = Router()
    for prompt in (100, 2000, 5000):
        prfaas, pd = clusters(pd_hits=(min(prompt, 1500), 0))
        router.route(RouteInput(prompt, T, Rule.SCARCE, prfaas, pd))
    assert router.paths == {Path.PD: 2, Path.PRFAAS: 1}
    assert router.reasons == {RouteReason.SHORT: 1, RouteReason.SHORT_AFTER_CACHE: 1, RouteReason.LONG: 1}
    # the long one runs on PrfaaS, whose cache is cold
    assert router.prompt_tokens == 7100 and router.cached_tokens == 100 + 1500 + 0


hits = st.integers(0, 20_000)
node_lists = st.lists(st.tuples(hits, st.integers(0, 5000), st.booleans()), max_size=3)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.integers(1, 20_000),
    threshold=st.integers(0, 20_000),
    rule=st.sampled_from(Rule),
    pd_nodes=node_lists,
    prfaas_nodes=node_lists,
    kv=st.integers(0, 20_000),
    pool_hit=st.integers(0, 20_000),
    link_up=st.booleans(),
    move=st.booleans(),
    spill=st.sampled_from((0, 512)),
    utilisation=st.floats(0, 1),
)
def test_decisions_respect_the_threshold_rule(
    prompt: int,
    threshold: int,
    rule: Rule,
    pd_nodes: list[tuple[int, int, bool]],
    prfaas_nodes: list[tuple[int, int, bool]],
    kv: int,
    pool_hit: int,
    link_up: bool,
    move: bool,
    spill: int,
    utilisation: float,
) -> None:
    def view(name: str, nodes: list[tuple[int, int, bool]]) -> tuple[NodeView, ...]:
        return tuple(NodeView(f"{name}{i}", min(h, prompt), load, ok) for i, (h, load, ok) in enumerate(nodes))

    pd = ClusterView("pd", view("p", pd_nodes), (NodeView("d"),), min(kv, prompt), min(pool_hit, kv, prompt))
    prfaas = ClusterView("prfaas", view("x", prfaas_nodes))
    req = RouteInput(prompt, threshold, rule, prfaas, pd, link_up, utilisation)
    config = RouterConfig(cross_cluster_cache_move=move, spill_tokens=spill)
    d = decide(req, config)
    if d.path is Path.REJECT:
        assert not pd.can_prefill and not (prfaas.can_prefill and link_up)
        return
    cluster = prfaas if d.path is Path.PRFAAS else pd
    chosen = next(n for n in cluster.prefill_nodes if n.node_id == d.prefill_node)
    assert chosen.healthy and 0 <= d.incremental_tokens <= prompt
    if d.path is Path.PRFAAS:
        assert link_up
        counted = max(pd.hit_tokens, prfaas.hit_tokens) if rule is Rule.ABUNDANT and move else pd.hit_tokens
        spilled = (RouteReason.SHORT_BUT_PD_PREFILL_DOWN, RouteReason.SHORT_BUT_PD_BUSY)
        assert d.reason in spilled or prompt - counted > threshold
        if d.reason is RouteReason.SHORT_BUT_PD_BUSY:  # PD-P could have taken it, but is over ``spill`` tokens behind
            assert spill and utilisation < config.spill_below and d.cache_move is None

            def wait(n: NodeView, c: ClusterView) -> int:
                return n.load + prompt - max(n.hit_tokens, c.pool_hit_tokens)

            assert all(wait(n, pd) > wait(chosen, prfaas) + spill for n in pd.prefill_nodes if n.healthy)
    elif d.reason is not RouteReason.LONG_BUT_PRFAAS_DOWN:
        assert prompt - pd.hit_tokens <= threshold or (d.cache_move is not None and d.incremental_tokens <= threshold)
    if d.cache_move is not None:
        assert rule is Rule.ABUNDANT and move and link_up
        assert d.cache_move.dst == cluster.name and d.cache_move.start_tokens <= d.cache_move.end_tokens
    # without a cache move, ABUNDANT is SCARCE
    if not move:
        assert decide(dataclasses.replace(req, rule=Rule.SCARCE), config).path is d.path
    if not spill:  # without the spill, the link's utilisation does not matter
        assert decide(dataclasses.replace(req, link_utilisation=1.0), config) == d


def test_a_burst_of_short_prompts_spills_to_prfaas_while_pd_prefill_is_a_batch_behind() -> None:
    """Loads as the gateway counts them: each routed prompt adds its tokens to its prefill node at once."""

    def burst(config: RouterConfig, utilisation: float = 0.0) -> dict[str, int]:
        load = {"x0": 0, "p0": 0}
        for _ in range(32):
            prfaas = ClusterView("prfaas", (NodeView("x0", load=load["x0"]),))
            pd = ClusterView("pd", (NodeView("p0", load=load["p0"]),), (NodeView("d0"),))
            d = decide(RouteInput(64, T, Rule.SCARCE, prfaas, pd, link_utilisation=utilisation), config)
            assert d.reason in (RouteReason.SHORT, RouteReason.SHORT_BUT_PD_BUSY)
            load[d.prefill_node] += 64
        return load

    assert burst(RouterConfig()) == {"x0": 0, "p0": 2048}  # the threshold rule alone: every prompt on PD-P
    spilled = burst(RouterConfig(spill_tokens=512))
    assert spilled["x0"] > 0 and spilled["p0"] - spilled["x0"] <= 512 + 64  # PD-P stays at most a batch ahead
    assert burst(RouterConfig(spill_tokens=512), utilisation=0.6) == {"x0": 0, "p0": 2048}  # the link has no room


def test_no_spill_when_pd_prefill_holds_the_prefix_or_prfaas_is_as_busy() -> None:
    busy_pd = (NodeView("p0", hit_tokens=0, load=4000),)
    spill = RouterConfig(spill_tokens=512)

    def one(pd_nodes: tuple[NodeView, ...], prfaas_load: int, link_up: bool = True) -> RouteDecision:
        prfaas = ClusterView("prfaas", (NodeView("x0", load=prfaas_load),))
        pd = ClusterView("pd", pd_nodes, (NodeView("d0"),))
        return decide(RouteInput(900, T, Rule.SCARCE, prfaas, pd, link_up), spill)

    assert one(busy_pd, 0).reason is RouteReason.SHORT_BUT_PD_BUSY
    assert one(busy_pd, 0).path is Path.PRFAAS and one(busy_pd, 0).prefill_node == "x0"
    assert one(busy_pd, 3500).reason is RouteReason.SHORT  # PrfaaS would reach it less than 512 tokens sooner
    assert one(busy_pd, 0, link_up=False).reason is RouteReason.SHORT
    # PD-P's node holds 800 of the 900 tokens: it computes 100 after its queue, PrfaaS all 900 after none
    assert one((NodeView("p0", hit_tokens=800, load=400),), 0).reason is RouteReason.SHORT
    with pytest.raises(ValueError, match="spill"):
        RouterConfig(spill_tokens=-1)


def test_a_long_prompt_stays_local_while_the_link_is_behind_by_more_than_its_bound() -> None:
    bounded = RouterConfig(max_link_backlog_s=30.0)

    def one(backlog_s: float, config: RouterConfig = bounded, pd_hits: tuple[int, ...] = (0,)) -> RouteDecision:
        prfaas, pd = clusters(pd_hits=pd_hits, prfaas_hits=(0,))
        return decide(RouteInput(T + 100, T, Rule.SCARCE, prfaas, pd, link_backlog_s=backlog_s), config)

    assert (one(30.0).path, one(30.0).reason) == (Path.PRFAAS, RouteReason.LONG)  # at the bound: it still goes
    full = one(30.5)
    assert (full.path, full.reason, full.prefill_node, full.cache_move) == (
        Path.PD, RouteReason.LONG_BUT_LINK_FULL, "p0", None
    )  # fmt: skip
    assert one(1e9, RouterConfig()).reason is RouteReason.LONG  # 0: no bound
    assert one(float("inf")).reason is RouteReason.LONG_BUT_LINK_FULL  # the link cut with state on it
    prfaas, _ = clusters(prfaas_hits=(0,))
    no_pd = ClusterView("pd", (NodeView("p0", healthy=False),), (NodeView("d0"),))
    alone = decide(RouteInput(T + 1, T, Rule.SCARCE, prfaas, no_pd, link_backlog_s=60.0), bounded)
    assert alone.path is Path.PRFAAS  # nowhere else to prefill it
    assert one(60.0, pd_hits=(64,)).cached_tokens == 64  # PD-P loads its own hit, and computes the rest
    with pytest.raises(ValueError, match="max_link_backlog_s"):
        RouterConfig(max_link_backlog_s=-1)
    with pytest.raises(ValueError, match="link_backlog_s"):
        RouteInput(T, T, Rule.SCARCE, prfaas, no_pd, link_backlog_s=-1)
