"""What a simulated deployment is made of: profiles, instance counts, routing, link, measurement, policies.

Each policy is a spec (a built-in name or module:Class) with its keyword arguments, loaded as the gateway does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minifaas.planner.case import PlanCase
from minifaas.planner.model import OperatingPoint
from minifaas.planner.profile import DecodeProfile, PrefillProfile
from minifaas.policy.codec_policy import CodecEstimate
from minifaas.policy.long_term import LongTermConfig
from minifaas.policy.plugin import CODEC, LONG_TERM, ROUTER, SHORT_TERM, SNAPSHOT, Args, check_policy, policy_args
from minifaas.policy.router import RouterConfig, Rule
from minifaas.policy.short_term import ShortTermConfig
from minifaas.sim.fluid_link import LinkConfig

NO_OFFLOAD = 10**12  # a threshold no prompt exceeds
# lossless byte-plane coding of bf16 KV on a GPU (SplitZip, arXiv 2605.01708)
GPU_LOSSLESS = CodecEstimate(ratio=1.3, encode_bps=200e9, decode_bps=200e9)


@dataclass(frozen=True)
class SimConfig:
    prfaas: PrefillProfile
    pd_prefill: PrefillProfile
    decode: DecodeProfile
    n_prfaas: int
    n_prefill: int
    n_decode: int
    threshold: int  # tokens of incremental prefill above which a request is offloaded
    rule: Rule = Rule.SCARCE
    router: RouterConfig = field(default_factory=RouterConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    prefix_cache: bool = True  # off: ignore hash ids, every prompt is prefilled in full
    cache_bytes: float = float("inf")  # per cluster pool
    snapshot_interval_blocks: int = 8  # linear-state snapshots every this many blocks (plus prompt ends)
    warmup_s: float = 0.0  # completions before this are not counted in throughput
    drain: bool = True  # run until every request finishes, or stop at the last arrival
    # the first token at the prefill's end, as the gateway sends it; off: after the KV lands and one decode step
    early_first_token: bool = False
    # a prompt whose end snapshot the cluster holds is served whole, its first token from the logits kept there
    whole_prompt_hits: bool = False
    # every worker on one host of this many cores: while n workers compute, each goes at 1 / slowdown(n) of its
    # profile's speed, n counted again whenever one starts or stops; 0: each worker on hardware of its own
    shared_cores: int = 0
    # on that host, a prefill's slowdown with n = 1, 2, ... workers computing (``slowdown``); empty: n over the cores
    contention: tuple[float, ...] = ()
    # a prefill's slowdown while the one other worker computing is a decode instance (its attention reads every
    # row's state); 0: as ``contention`` gives for two workers
    beside_decode: float = 0.0
    # prompts of one length with no cached prefix share a prefill forward of at most this many tokens; 0: never
    prefill_batch_tokens: int = 0
    # a prefill worker's own time between forwards (keeping a prompt's blocks, the next prompt's turn, planning
    # it), at the profile's speed: a node starts its next forward this long after one ends
    prefill_turnaround_s: float = 0.0
    # a decode step takes the profile's time at the rows running now; off: every step takes ``step_time_s``
    decode_step_by_batch: bool = False
    # with it, a step waits this many times its length (at most ``decode_hold_max_s``) while more requests are on
    # their way to its instance than it holds, as a decode worker on a CPU waits for rows
    decode_hold: float = 0.0
    decode_hold_max_s: float = 0.05
    # every token reaches the client this long after its worker makes it (the gateway's messages, the HTTP stream)
    delivery_s: float = 0.0
    sample_s: float = 1.0  # queue-depth sampling period, and the scheduler's tick
    short_term: ShortTermConfig | None = None  # None: t and the rule stay fixed
    long_term: LongTermConfig | None = None  # None: no re-planning, no role conversion
    convert_s: float = 60.0  # a drained PD worker restarts in its new role this much later
    kv_compression: str = "none"  # codec of PrfaaS transfers (policy.compression); none: state crosses as it is
    codecs: tuple[tuple[str, CodecEstimate], ...] = (("lossless", GPU_LOSSLESS),)  # what the policy weighs
    kv_compression_args: Args = ()
    router_policy: str = "default"  # the routing policy
    router_args: Args = ()
    short_term_policy: str = "default"  # run when ``short_term`` is set
    short_term_args: Args = ()
    long_term_policy: str = "default"  # run when ``long_term`` is set
    long_term_args: Args = ()
    snapshot_policy: str = "interval"  # where the pools keep state snapshots (every ``snapshot_interval_blocks``)
    snapshot_args: Args = ()

    def __post_init__(self) -> None:
        if min(self.n_prfaas, self.n_prefill, self.n_decode) < 0 or self.n_decode < 1:
            raise ValueError("instance counts must be >= 0, with at least one decode instance")
        if self.n_prfaas + self.n_prefill < 1:
            raise ValueError("need at least one prefill instance")
        if self.threshold < 0 or self.warmup_s < 0 or self.sample_s <= 0 or self.cache_bytes <= 0:
            raise ValueError("threshold, warmup_s >= 0; sample_s, cache_bytes > 0")
        if self.convert_s < 0:
            raise ValueError("convert_s must be >= 0")
        if self.snapshot_interval_blocks < 0:
            raise ValueError("snapshot_interval_blocks must be >= 0")
        if min(self.shared_cores, self.delivery_s, self.beside_decode, self.prefill_turnaround_s) < 0:
            raise ValueError("shared_cores, delivery_s, beside_decode and prefill_turnaround_s must be >= 0")
        if any(s <= 0 for s in self.contention):
            raise ValueError("every contention figure must be > 0")
        named = self.kv_compression in CODEC.builtins
        if named and self.kv_compression not in ("none", "auto", *dict(self.codecs)):
            raise ValueError(f"kv_compression {self.kv_compression}: no figures for that codec in codecs")
        for spec, field_name, kind in _POLICIES:
            args = policy_args(getattr(self, field_name))
            object.__setattr__(self, field_name, args)
            check_policy(getattr(self, spec), kind, args)

    def slowdown(self, computing: float) -> float:
        """A worker's time over the profile's while ``computing`` workers (itself counted) share
        ``shared_cores``: the ``contention`` table's figure (past its end scaled by the count); past the cores the
        workers take turns on them, so never less than the figure with every core busy, times their share. A
        fractional count (a decode worker that computes only part of each step) lies between its neighbours."""
        cores, table = self.shared_cores, self.contention
        if not cores:
            return 1.0

        def measured(n: int) -> float:
            if not table:
                return max(1.0, n / cores)
            return table[n - 1] if n <= len(table) else table[-1] * n / len(table)

        def whole(n: int) -> float:
            return measured(n) if n <= cores else max(measured(n), measured(cores) * n / cores)

        computing = max(computing, 1.0)
        low = math.floor(computing)
        if computing == low:
            return whole(low)
        return whole(low) + (whole(low + 1) - whole(low)) * (computing - low)

    @property
    def gpus(self) -> int:
        prefill = self.n_prfaas * self.prfaas.gpus_per_instance + self.n_prefill * self.pd_prefill.gpus_per_instance
        return prefill + self.n_decode * self.decode.gpus_per_instance


_POLICIES = (  # (spec field, args field, kind)
    ("router_policy", "router_args", ROUTER),
    ("short_term_policy", "short_term_args", SHORT_TERM),
    ("long_term_policy", "long_term_args", LONG_TERM),
    ("snapshot_policy", "snapshot_args", SNAPSHOT),
    ("kv_compression", "kv_compression_args", CODEC),
)


def config_for(case: PlanCase, point: OperatingPoint, link: LinkConfig | None = None, **extra: object) -> SimConfig:
    """The simulated twin of one planned configuration (prfaas, homogeneous or naive)."""
    if point.threshold_tokens is not None:
        threshold = int(point.threshold_tokens)
    else:
        threshold = 0 if point.n_prefill == 0 else NO_OFFLOAD
    return SimConfig(
        prfaas=case.prfaas,
        pd_prefill=case.pd_prefill,
        decode=case.decode,
        n_prfaas=point.n_prfaas,
        n_prefill=point.n_prefill,
        n_decode=point.n_decode,
        threshold=threshold,
        link=link or LinkConfig(gbps=case.link_gbps),
        **extra,  # type: ignore[arg-type]
    )
