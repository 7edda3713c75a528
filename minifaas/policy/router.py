"""The PrfaaS router: where one request is prefilled, where it decodes, and why.

It routes on the incremental length l = prompt - usable cached prefix: l > t is offloaded to the PrfaaS cluster
(unless the link is behind by more than ``max_link_backlog_s``), l <= t is prefilled on a PD-P node. The rule
says whose cached prefix counts (SCARCE: the PD cluster's own; ABUNDANT: the longer, moved across first), and in
a cluster the node that would finish first wins. ``decide`` is a pure function of its input; ``Router`` adds
counters.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum


class Rule(StrEnum):
    SCARCE = "scarce"
    ABUNDANT = "abundant"


class Path(StrEnum):
    PRFAAS = "prfaas"  # prefill in the PrfaaS cluster, decode in PD-D
    PD = "pd"  # prefill in PD-P, decode in PD-D
    REJECT = "reject"  # no healthy node can serve it now


class RouteReason(StrEnum):
    SHORT = "short"  # prompt <= t without any cache
    SHORT_AFTER_CACHE = "short_after_cache"  # prompt > t, but the local hit brings l <= t
    SHORT_AFTER_CACHE_MOVE = "short_after_cache_move"  # the PrfaaS cache, moved to PD, brings l <= t
    LONG = "long"  # l > t: offload
    LONG_BUT_PRFAAS_DOWN = "long_but_prfaas_down"  # no healthy PrfaaS node or link down: stay local
    LONG_BUT_LINK_FULL = "long_but_link_full"  # the link needs over max_link_backlog_s for what it carries: stay local
    SHORT_BUT_PD_PREFILL_DOWN = "short_but_pd_prefill_down"  # no healthy PD-P node: offload
    SHORT_BUT_PD_BUSY = "short_but_pd_busy"  # l <= t, but PD-P's queue is far longer than PrfaaS's: spill over
    NO_DECODE_NODE = "no_decode_node"
    NO_PREFILL_NODE = "no_prefill_node"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    cross_cluster_cache_move: bool = True  # off: the ABUNDANT rule judges PD by its own cache, like SCARCE
    incremental_transfer: bool = True  # off: PrfaaS ships the whole prompt's KV even if PD holds a prefix
    cache_affinity: bool = True  # off: pick the least-loaded node, ignoring where the prefix sits
    spill_tokens: int = 0  # a short prompt spills to PrfaaS when its queue there is this much shorter (0: never)
    spill_below: float = 0.6  # ... and only while the link's utilisation is under this
    max_link_backlog_s: float = 0.0  # a long prompt stays local while the link's backlog is over this (0: no bound)

    def __post_init__(self) -> None:
        if self.spill_tokens < 0 or not 0 <= self.spill_below <= 1 or self.max_link_backlog_s < 0:
            raise ValueError("need spill_tokens >= 0 (0: no spill), 0 <= spill_below <= 1 and max_link_backlog_s >= 0")


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the router sees it: ``load`` is queued work in tokens (prefill) or any comparable figure
    (decode); ``hit_tokens`` the usable prefix in its own memory (a decode node's: the KV it holds)."""

    node_id: str
    hit_tokens: int = 0
    load: float = 0.0
    healthy: bool = True

    def __post_init__(self) -> None:
        if self.hit_tokens < 0 or self.load < 0:
            raise ValueError(f"node {self.node_id}: hit_tokens and load must be >= 0")


@dataclass(frozen=True, slots=True)
class ClusterView:
    """A cluster's nodes and its shared pool. ``pool_hit_tokens`` is the usable prefix in the pool, which every
    node can load; ``kv_prefix_tokens`` is the pool's full-attention KV prefix, snapshot or not, which a decode
    node or a cache move need not resend."""

    name: str
    prefill_nodes: tuple[NodeView, ...] = ()
    decode_nodes: tuple[NodeView, ...] = ()
    kv_prefix_tokens: int = 0
    pool_hit_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kv_prefix_tokens < 0 or self.pool_hit_tokens < 0:
            raise ValueError(f"cluster {self.name}: kv_prefix_tokens and pool_hit_tokens must be >= 0")

    @property
    def hit_tokens(self) -> int:
        """The cluster's usable hit: its pool's, or a healthy node's own if longer."""
        best = self.pool_hit_tokens
        for n in self.prefill_nodes:
            if n.healthy and n.hit_tokens > best:
                best = n.hit_tokens
        return best

    @property
    def can_prefill(self) -> bool:
        return any(n.healthy for n in self.prefill_nodes)


@dataclass(frozen=True, slots=True)
class RouteInput:
    prompt_tokens: int
    threshold: int
    rule: Rule
    prfaas: ClusterView
    pd: ClusterView
    link_up: bool = True
    link_utilisation: float = 0.0  # the link's smoothed utilisation (the short-term policy's reading)
    link_backlog_s: float = 0.0  # seconds the link needs for the KV already routed across it and not yet there

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.threshold < 0 or self.link_utilisation < 0 or self.link_backlog_s < 0:
            raise ValueError("need prompt_tokens >= 1 and threshold, link_utilisation and link_backlog_s >= 0, got "
                             f"{self.prompt_tokens}, {self.threshold}, {self.link_utilisation}, "
                             f"{self.link_backlog_s}")  # fmt: skip
        for cluster in (self.prfaas, self.pd):
            if cluster.hit_tokens > self.prompt_tokens or cluster.kv_prefix_tokens > self.prompt_tokens:
                raise ValueError(f"cluster {cluster.name}: a cached prefix is longer than the prompt")


@dataclass(frozen=True, slots=True)
class CacheMove:
    """Before prefill, ``src``'s usable prefix goes to ``dst``: the KV of [start_tokens, end_tokens), plus the
    snapshot at end_tokens."""

    src: str
    dst: str
    start_tokens: int
    end_tokens: int


@dataclass(frozen=True, slots=True)
class RouteDecision:
    path: Path
    reason: RouteReason
    prompt_tokens: int
    prefill_node: str | None = None
    decode_node: str | None = None
    cached_tokens: int = 0  # the prefix the prefill node loads instead of computing
    cache_move: CacheMove | None = None
    decode_kv_tokens: int = 0  # the prompt's full-attention KV the decode side holds (0: incremental transfer off)

    @property
    def incremental_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def link_kv_start(self) -> int:
        """PRFAAS: full-attention KV of tokens [link_kv_start, prompt) crosses the link; 0 on the PD path."""
        return self.decode_kv_tokens if self.path is Path.PRFAAS else 0


def pick_node(nodes: tuple[NodeView, ...], prompt_tokens: int, affinity: bool, floor_hit: int = 0) -> NodeView | None:
    """The healthy node that would finish first. ``floor_hit`` is the prefix every node can load (the pool's, or
    one moved into it); of equally good nodes, the one holding more of the prefix wins, then the lower id."""
    if len(nodes) == 1:  # the common case in the simulator, kept cheap
        return nodes[0] if nodes[0].healthy else None
    healthy = [n for n in nodes if n.healthy]
    if not healthy:
        return None

    def cost(n: NodeView) -> tuple[float, int, str]:
        if not affinity:
            return (n.load, 0, n.node_id)
        return (n.load + prompt_tokens - max(n.hit_tokens, floor_hit), -n.hit_tokens, n.node_id)

    return min(healthy, key=cost)


def decide(req: RouteInput, config: RouterConfig = RouterConfig()) -> RouteDecision:
    decode = pick_node(req.pd.decode_nodes, 0, affinity=False)
    if decode is None:
        return RouteDecision(Path.REJECT, RouteReason.NO_DECODE_NODE, req.prompt_tokens)
    prfaas_ok = req.link_up and req.prfaas.can_prefill
    pd_ok = req.pd.can_prefill
    if not (prfaas_ok or pd_ok):
        return RouteDecision(Path.REJECT, RouteReason.NO_PREFILL_NODE, req.prompt_tokens)

    l_pd, l_prfaas = req.pd.hit_tokens, req.prfaas.hit_tokens
    move_allowed = req.rule is Rule.ABUNDANT and config.cross_cluster_cache_move and req.link_up
    local_prefix = max(l_pd, l_prfaas) if move_allowed else l_pd
    short = req.prompt_tokens - local_prefix <= req.threshold

    if short and pd_ok:
        reason = RouteReason.SHORT if req.prompt_tokens <= req.threshold else RouteReason.SHORT_AFTER_CACHE
        move = None
        if local_prefix > l_pd:  # only the PrfaaS cache makes it short: bring it over
            move = CacheMove(req.prfaas.name, req.pd.name, min(req.pd.kv_prefix_tokens, l_prfaas), l_prfaas)
            reason = RouteReason.SHORT_AFTER_CACHE_MOVE
        if move is None and prfaas_ok and _spills(req, config):
            return _place(req, config, Path.PRFAAS, decode, RouteReason.SHORT_BUT_PD_BUSY, None)
        return _place(req, config, Path.PD, decode, reason, move)
    if not short and not prfaas_ok:
        return _place(req, config, Path.PD, decode, RouteReason.LONG_BUT_PRFAAS_DOWN, None)
    if not short and pd_ok and 0 < config.max_link_backlog_s < req.link_backlog_s:
        return _place(req, config, Path.PD, decode, RouteReason.LONG_BUT_LINK_FULL, None)
    reason = RouteReason.LONG if not short else RouteReason.SHORT_BUT_PD_PREFILL_DOWN
    move = None
    if move_allowed and l_pd > l_prfaas:  # the longer cache is local: send it to PrfaaS first
        move = CacheMove(req.pd.name, req.prfaas.name, min(req.prfaas.kv_prefix_tokens, l_pd), l_pd)
    return _place(req, config, Path.PRFAAS, decode, reason, move)


def _spills(req: RouteInput, config: RouterConfig) -> bool:
    """A short prompt would reach a PrfaaS prefill node more than ``spill_tokens`` queued tokens sooner than a
    PD-P one (each counting what it must compute), and the link has room: PD-P is backlogged, PrfaaS is not."""
    if not config.spill_tokens or req.link_utilisation >= config.spill_below:
        return False

    def wait(cluster: ClusterView) -> float:
        node = pick_node(cluster.prefill_nodes, req.prompt_tokens, config.cache_affinity, cluster.pool_hit_tokens)
        assert node is not None  # decide() checked that both clusters can prefill
        return node.load + req.prompt_tokens - max(node.hit_tokens, cluster.pool_hit_tokens)

    return wait(req.prfaas) + config.spill_tokens < wait(req.pd)


def _place(
    req: RouteInput, config: RouterConfig, path: Path, decode: NodeView, reason: RouteReason, move: CacheMove | None
) -> RouteDecision:
    cluster = req.prfaas if path is Path.PRFAAS else req.pd
    floor = max(cluster.pool_hit_tokens, move.end_tokens if move else 0)
    node = pick_node(cluster.prefill_nodes, req.prompt_tokens, config.cache_affinity, floor)
    assert node is not None  # decide() checked that the cluster can prefill
    cached = max(node.hit_tokens, floor)
    # the decode node loads its cluster pool's KV prefix, or its own if longer: that much need not be sent
    held = min(max(req.pd.kv_prefix_tokens, decode.hit_tokens), req.prompt_tokens) if config.incremental_transfer else 0
    return RouteDecision(path, reason, req.prompt_tokens, node.node_id, decode.node_id, cached, move, held)


class Router:
    """``decide`` plus counters: every decision by path and by reason."""

    def __init__(self, config: RouterConfig = RouterConfig()) -> None:
        if not isinstance(config, RouterConfig):  # a --router-arg config=VALUE in place of the deployment's
            raise TypeError(f"config must be a RouterConfig, got {config!r}")
        self.config = config
        self.paths: Counter[Path] = Counter()
        self.reasons: Counter[RouteReason] = Counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def route(self, req: RouteInput) -> RouteDecision:
        decision = decide(req, self.config)
        self.paths[decision.path] += 1
        self.reasons[decision.reason] += 1
        if decision.path is not Path.REJECT:
            self.prompt_tokens += decision.prompt_tokens
            self.cached_tokens += decision.cached_tokens
        return decision
