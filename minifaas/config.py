"""Serving configuration: frozen dataclasses, one per role, loadable from a TOML file.

The TOML tables are [serve], [http], [prfaas], [pd], [link], [ray], [cache] and [scheduler]. A policy (router,
short_term, ...) is a built-in name or module:Class; ``<key>_args``: its arguments.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import NoneType

from minifaas.emulator.pacer import check_window, parse_bytes, parse_rate
from minifaas.model.loader import DEFAULT_MODEL, DTYPE_CHOICES, dtype_name
from minifaas.net.address import parse_address
from minifaas.net.connections import DEFAULT_CONNECTIONS, MAX_CONNECTIONS
from minifaas.policy.plugin import CODEC, LONG_TERM, ROUTER, SHORT_TERM, SNAPSHOT, Args, check_policy, policy_args

SNAPSHOT_POLICIES = tuple(SNAPSHOT.builtins)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# the start of a worker's name, by (cluster, role)
NAME_PREFIX = {("prfaas", "prefill"): "prfaas-p", ("pd", "prefill"): "pd-p", ("pd", "decode"): "pd-d"}


def check_finite(config: object) -> None:
    """Every number of ``config`` finite: a NaN passes every comparison the checks below make."""
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value}")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    prefill_workers: int = 1
    decode_workers: int = 0
    device: str = "cpu"  # "cpu" or "cuda:N"; every worker of the cluster goes there (unless ``devices``)
    max_batch: int = 0  # decode rows per forward on its decode workers (1: unbatched; 0: what their memory holds)
    prefill_chunk: int = 512  # prompt tokens per forward on its prefill workers; each chunk's KV streams out (0: one)
    prefill_batch: int = 512  # queued prompts of one length share a forward of at most this many tokens (0: not)
    workers: tuple[str, ...] = ()  # control addresses of hand-started workers; the counts then do not apply
    dtype: str | None = None  # the weights' dtype on its workers; None: [serve] dtype
    threads: int = 0  # torch threads per worker (0: auto, see ServeConfig.worker_threads)
    decode_threads: int = 0  # torch threads per decode worker (0: as ``threads``)
    devices: tuple[str, ...] = ()  # GPUs its workers are dealt to in turn, prefill workers first ("cuda:N")
    memory_fraction: float = 0.0  # of its GPU per worker; 0: an equal share where workers share one, else all

    def __post_init__(self) -> None:
        check_finite(self)
        object.__setattr__(self, "workers", tuple(self.workers))  # a TOML array comes as a list
        object.__setattr__(self, "devices", tuple(self.devices))
        if self.devices:
            bad = [d for d in self.devices if not re.fullmatch(r"cuda:\d+", d)]
            if bad or len(set(self.devices)) < len(self.devices):
                raise ValueError(f"devices must be distinct cuda:N, got {list(self.devices)}")
            if self.device not in ("cpu", self.devices[0]):
                raise ValueError(f"give device or devices, not both (device {self.device}, devices {self.devices})")
            object.__setattr__(self, "device", self.devices[0])  # the kind of device, for dtype and threads
        if not 0 <= self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in [0, 1], got {self.memory_fraction}")
        for address in self.workers:
            parse_address(address)
        if self.dtype is not None and self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("worker counts must be >= 0")
        if self.max_batch < 0:
            raise ValueError(f"max_batch must be >= 0 (0: sized by memory), got {self.max_batch}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {self.prefill_chunk}")
        if self.prefill_batch < 0:
            raise ValueError(f"prefill_batch must be >= 0, got {self.prefill_batch}")
        if self.threads < 0 or self.decode_threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads} and decode_threads {self.decode_threads}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda:N, got {self.device!r}")
        if self.memory_fraction and self.device == "cpu":
            raise ValueError("memory_fraction is a GPU's: the cluster runs on the CPU")
        if len(self.devices) > self.prefill_workers + self.decode_workers and not self.workers:
            raise ValueError(f"{len(self.devices)} devices for {self.prefill_workers + self.decode_workers} "
                             "workers: give each device a worker")  # fmt: skip

    def placement(self) -> list[tuple[str, int, str]]:
        """(role, index, device) of each worker the gateway starts for this cluster: devices dealt in turn."""
        devices = self.devices or (self.device,)
        roles = [("prefill", i) for i in range(self.prefill_workers)]
        roles += [("decode", i) for i in range(self.decode_workers)]
        return [(role, i, devices[k % len(devices)]) for k, (role, i) in enumerate(roles)]


@dataclass(frozen=True, slots=True)
class InterClusterLinkConfig:
    rate: str = "100mbit"  # inter-cluster bandwidth: the emulator's, or a real link's capacity ("none": unlimited)
    flow_rate: str = "none"  # per-connection cap
    window: str = "none"  # bytes in flight per connection, e.g. "4MiB": one moves at most window / RTT
    delay_ms: float = 5.0  # one way
    jitter_ms: float = 0.0
    connections: int = DEFAULT_CONNECTIONS  # TCP connections per KV transfer
    pipelined: bool = True
    kv_compression: str = "auto"  # the codec policy; auto: lossless only where it saves time; or module:Class
    emulated: bool | None = None  # through the link emulator; None: when every worker is a local child
    kv_compression_args: Args = ()  # the codec policy's keyword arguments

    def __post_init__(self) -> None:
        check_finite(self)
        if not 1 <= self.connections <= MAX_CONNECTIONS or not 0 <= self.jitter_ms <= self.delay_ms:
            raise ValueError(f"need connections 1..{MAX_CONNECTIONS}, delay_ms >= 0 and 0 <= jitter_ms <= delay_ms")
        for rate in (self.rate, self.flow_rate):  # a rate the emulator cannot read fails here, not in its process
            parse_rate(rate)
        check_window(parse_bytes(self.window))
        object.__setattr__(self, "kv_compression_args", policy_args(self.kv_compression_args))
        check_policy(self.kv_compression, CODEC, self.kv_compression_args)

    @property
    def worker_codecs(self) -> str:
        """The codecs the workers offer (``--kv-compression``): a built-in's own, none and lossless for any other."""
        return self.kv_compression if self.kv_compression in CODEC.builtins else "auto"


@dataclass(frozen=True, slots=True)
class RayConfig:
    """Workers as Ray actors (``launcher = "ray"``): each on a node holding its cluster's custom resource."""

    address: str = "auto"  # a running cluster ("auto": the one this host belongs to; "local": start one here)
    namespace: str = "minifaas"
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0  # for workers on a cuda device; CPU workers reserve none
    start_timeout: float = 300.0  # placement of every worker, and a restarted actor's readiness

    def __post_init__(self) -> None:
        check_finite(self)
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0 or self.start_timeout <= 0:
            raise ValueError("need cpus_per_worker >= 0, gpus_per_worker >= 0 and start_timeout > 0")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Each prefill node's prefix cache (held in the worker's own memory) and how routing uses it."""

    mode: str = "hybrid"  # "none": no hits, nothing stored, routing on prompt length alone
    block_size: int = 32  # tokens per full-attention block
    snapshot_policy: str = "reuse"  # where linear-state snapshots go; "interval": every N blocks; or module:Class
    snapshot_policy_args: Args = ()  # its keyword arguments (the interval policy's spacing is the next setting)
    snapshot_interval_blocks: int = 4  # the interval policy's spacing; 0: state snapshots only at prompt ends
    capacity_mib: float = 256.0  # per prefill node
    rule: str = "scarce"  # at start (the scheduler may switch it): "scarce" or "abundant" (the longer cache counts)
    incremental_transfer: bool = True  # off: PrfaaS ships the whole KV even when the decode node holds a prefix
    cross_cluster_moves: bool = True  # off: no cache crosses the link before prefill (ABUNDANT then acts as SCARCE)

    def __post_init__(self) -> None:
        check_finite(self)
        if self.mode not in ("hybrid", "none") or self.rule not in ("scarce", "abundant"):
            raise ValueError(f"cache mode must be hybrid|none and rule scarce|abundant, got {self.mode}, {self.rule}")
        object.__setattr__(self, "snapshot_policy_args", policy_args(self.snapshot_policy_args))
        check_policy(self.snapshot_policy, SNAPSHOT, self.snapshot_policy_args)
        if self.block_size < 1 or self.snapshot_interval_blocks < 0 or self.capacity_mib < 0:
            raise ValueError("need block_size >= 1, snapshot_interval_blocks >= 0, capacity_mib >= 0")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def moves(self) -> bool:
        return self.enabled and self.cross_cluster_moves


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The long-term loop: re-plan (t, N_p, N_d) from measured traffic and re-role PD workers.
    It needs a profile of the instances (``minifaas profile`` writes one); without one it stays off."""

    profile: str | None = None  # [prefill] and [decode] tables of a PD instance
    prfaas_profile: str | None = None  # [prefill] of a PrfaaS instance; default: ``profile``'s
    rebalance: bool = True  # off switch: no re-planning, no role conversion
    period_s: float = 300.0  # between re-plans (scheduler.long_term says why 300)
    min_requests: int = 200  # a period with fewer routed prompts is not re-planned
    min_gain: float = 0.05  # a new split must plan this much more throughput
    drain_timeout: float = 120.0  # a worker changing role that still holds requests after this keeps its role
    short_term: str = "default"  # the short-term policy (t and the rule, each second): built-in or module:Class
    short_term_args: Args = ()
    long_term: str = "default"  # the long-term policy (the P:D split, once a period; needs ``profile``)
    long_term_args: Args = ()

    def __post_init__(self) -> None:
        check_finite(self)
        if self.period_s <= 0 or self.min_requests < 1 or self.min_gain < 0 or self.drain_timeout <= 0:
            raise ValueError("need period_s > 0, min_requests >= 1, min_gain >= 0, drain_timeout > 0")
        for name, kind in (("short_term", SHORT_TERM), ("long_term", LONG_TERM)):
            object.__setattr__(self, f"{name}_args", policy_args(getattr(self, f"{name}_args")))
            check_policy(getattr(self, name), kind, getattr(self, f"{name}_args"))
        if self.long_term != "default" and self.profile is None:
            raise ValueError(f"long-term policy {self.long_term!r}: it re-plans from a profile of the instances "
                             "([scheduler] profile, --profile)")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.rebalance and self.profile is not None


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """What one client may hold of the HTTP server: nothing forever, and never the last descriptor."""

    max_connections: int = 1024  # open client connections; one more is answered 503 (the fd limit may lower it)
    header_timeout: float = 15.0  # to send a request's line and headers, from connecting or the last response
    body_timeout: float = 30.0  # to send the request body once its headers are in
    max_body_bytes: int = 4 << 20
    backlog: int = 512  # connections the kernel queues before they are accepted
    shutdown_grace: float = 30.0  # once told to stop: how long requests in flight have to finish before they are cut

    def __post_init__(self) -> None:
        check_finite(self)
        if self.max_connections < 1 or self.max_body_bytes < 1 or self.backlog < 1:
            raise ValueError("need max_connections, max_body_bytes and backlog >= 1")
        if min(self.header_timeout, self.body_timeout) <= 0 or self.shutdown_grace < 0:
            raise ValueError("header_timeout and body_timeout must be positive, shutdown_grace >= 0")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # of every worker, unless its cluster sets one; auto: bfloat16 on CUDA, float32 on CPU
    trust_remote_code: bool = False  # let a checkpoint's own Python code (auto_map) run, in every process
    allow_slow_kernels: bool = False  # a CUDA worker may run the torch reference kernels (else it refuses)
    seed: int = 0
    threshold: int = 512  # prompts longer than this (incremental tokens) are prefilled on PrfaaS
    fixed_threshold: bool = False  # off switch of the scheduler: t and the routing rule never move
    spill_tokens: int = 512  # a short prompt goes to PrfaaS while PD-P's queue is this much longer (0: never)
    max_link_backlog_s: float = 30.0  # a long prompt stays local while the link needs longer for its KV (0: no bound)
    api_key: str | None = None
    first_token_timeout: float = 300.0  # a request with no first token by then fails (504)
    token_timeout: float = 60.0  # nor may the gateway be silent longer than this between two tokens
    request_timeout: float | None = None  # a limit on the whole request, however it streams (None: none)
    prefill_timeout: float = 120.0  # a prefill (and its transfer) that takes longer falls back to PD-P
    migration_limit: int | None = None  # moves to another decode worker after losing its own; None: deadlines decide
    max_queued_requests: int = 4096  # requests in flight; one more is answered 503 (0: no bound by count)
    max_queued_tokens: int = 0  # prompt tokens in flight (0: what a quarter of this host's memory holds)
    launcher: str = "local"  # who starts the workers: "local" (child processes) or "ray" (actors)
    fork_workers: bool = True  # local CPU workers fork from a parent that imported torch and the model once
    secret_file: str | None = None  # the cluster secret (else $MINIFAAS_SECRET); needed with any remote worker
    heartbeat_s: float = 1.0  # the gateway pings every worker this often
    heartbeat_deadline_s: float = 5.0  # a worker silent for this long leaves routing until it answers again
    router: str = "default"  # the routing policy: a built-in name or module:Class (docs/POLICIES.md)
    router_args: Args = ()  # its constructor's keyword arguments
    worker_log_level: str = "WARNING"  # the least severe lines the gateway's workers log (on its stderr)
    prfaas: ClusterConfig = field(default_factory=lambda: ClusterConfig(prefill_workers=1))
    pd: ClusterConfig = field(default_factory=lambda: ClusterConfig(prefill_workers=1, decode_workers=1))
    link: InterClusterLinkConfig = field(default_factory=InterClusterLinkConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        check_finite(self)
        if min(self.threshold, self.spill_tokens, self.max_link_backlog_s) < 0 or not 0 <= self.port < 65536:
            raise ValueError("need threshold >= 0, spill_tokens and max_link_backlog_s >= 0 (0: none), a valid port")
        object.__setattr__(self, "router_args", policy_args(self.router_args))
        check_policy(self.router, ROUTER, self.router_args)
        if self.pd.decode_workers < 1 and not self.pd.workers:
            raise ValueError("the PD cluster needs at least one decode worker")
        if self.prfaas.decode_workers:
            raise ValueError("the PrfaaS cluster only prefills: [prfaas] decode_workers must be 0")
        if self.pd.prefill_workers + self.prfaas.prefill_workers < 1 and not (self.pd.workers or self.prfaas.workers):
            raise ValueError("at least one prefill worker is needed")
        total = () if self.request_timeout is None else (self.request_timeout,)
        if min(self.first_token_timeout, self.token_timeout, self.prefill_timeout, *total) <= 0:
            raise ValueError("timeouts must be positive")
        if self.migration_limit is not None and self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.max_queued_requests < 0 or self.max_queued_tokens < 0:
            raise ValueError("need max_queued_requests >= 0 (0: no bound) and max_queued_tokens >= 0 (0: by memory)")
        if self.worker_log_level not in LOG_LEVELS:
            raise ValueError(f"worker_log_level must be one of {', '.join(LOG_LEVELS)}, got {self.worker_log_level!r}")
        if self.launcher not in ("local", "ray"):
            raise ValueError(f"launcher must be local or ray, got {self.launcher!r}")
        if not 0 < self.heartbeat_s < self.heartbeat_deadline_s:
            raise ValueError("need 0 < heartbeat_s < heartbeat_deadline_s")
        if self.launcher == "ray" and (self.prfaas.devices or self.pd.devices):
            raise ValueError("Ray gives each actor its GPUs: give a cluster's device (cuda:0) and "
                             "[ray] gpus_per_worker instead of devices")  # fmt: skip
        self._gpu_shares()  # raises if the workers placed on a GPU ask for more than all of it
        if self.link.emulated and not self.all_local:
            raise ValueError("the link emulator runs beside the gateway: with remote workers the link is the network")
        if self.scheduler.enabled and (self.pd.workers or self.prfaas.workers):
            raise ValueError("re-planning converts PD workers, and hand-started ones keep their role: --no-rebalance")

        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        prfaas, pd = self.worker_dtype("prfaas"), self.worker_dtype("pd")
        if self.prfaas.prefill_workers and prfaas != pd:  # state crosses as it is, byte for byte
            raise ValueError(f"the PrfaaS cluster would run {prfaas} and the PD cluster {pd}: KV moves between "
                             "them unconverted, so give both one dtype")  # fmt: skip

    @property
    def all_local(self) -> bool:
        """Every worker is a child process of the gateway, on this host."""
        return self.launcher == "local" and not (self.prfaas.workers or self.pd.workers)

    def memory_fraction(self, cluster: str, device: str) -> float:
        """The share of ``device`` a worker of ``cluster`` placed there may take (0: no limit)."""
        if device == "cpu":
            return 0.0
        return self.cluster(cluster).memory_fraction or self._gpu_shares().get(device, 0.0)

    def _gpu_shares(self) -> dict[str, float]:
        """Per GPU that local workers share: the equal share of it left to each worker not given a fraction."""
        placed: dict[str, list[float]] = {}  # the fraction each worker there asks for (0: none given)
        for c in (self.prfaas, self.pd):
            if self.launcher == "local" and not c.workers and c.device != "cpu":
                for _, _, device in c.placement():
                    placed.setdefault(device, []).append(c.memory_fraction)
        shares = {}
        for device, fractions in placed.items():
            left, auto = 1.0 - sum(fractions), fractions.count(0.0)
            if left < -1e-9 or (auto and len(fractions) > 1 and left <= 0):
                raise ValueError(f"the {len(fractions)} workers on {device} ask for more than all of it")
            if auto and len(fractions) > 1:
                shares[device] = left / auto
        return shares

    @property
    def forks_on_cpu_only(self) -> bool:
        """The gateway starts CPU workers here, forked from a pre-loaded parent, and no GPU worker."""
        clusters = (self.prfaas, self.pd)
        local = any(c.prefill_workers + c.decode_workers and not c.workers for c in clusters)
        on_cpu = all(c.device == "cpu" for c in clusters)
        return self.launcher == "local" and self.fork_workers and local and on_cpu

    @property
    def link_emulated(self) -> bool:
        return self.all_local if self.link.emulated is None else self.link.emulated

    def cluster(self, name: str) -> ClusterConfig:
        return self.prfaas if name == "prfaas" else self.pd

    def worker_dtype(self, cluster: str) -> str:
        """The dtype a worker of ``cluster`` loads the model in, "auto" resolved for its device."""
        c = self.cluster(cluster)
        return dtype_name(c.dtype or self.dtype, c.device)

    def worker_threads(self, cluster: str, role: str = "prefill") -> int:
        """Torch threads of a ``role`` worker of ``cluster`` that the gateway starts; 0 leaves torch's default.
        The cluster's ``threads`` (``decode_threads`` for a decode worker) when set; unset, local CPU workers
        share this host's cores rather than each taking a thread per core."""
        c = self.cluster(cluster)
        if role == "decode" and c.decode_threads:
            return c.decode_threads
        if c.threads or self.launcher != "local" or c.device != "cpu":
            return c.threads
        cpu = []  # (workers, their threads, 0: auto) of each local CPU cluster, by role
        for cc in (self.prfaas, self.pd):
            if cc.device == "cpu" and not cc.workers:
                cpu += [(cc.prefill_workers, cc.threads), (cc.decode_workers, cc.decode_threads or cc.threads)]
        told = sum(n * threads for n, threads in cpu)  # the cores of the workers whose threads are set
        auto = sum(n for n, threads in cpu if not threads)
        return max(1, (len(os.sched_getaffinity(0)) - told) // max(1, auto))

    @classmethod
    def from_toml(cls, path: str | Path) -> ServeConfig:
        data = tomllib.loads(Path(path).read_text())
        tables = ("serve", "prfaas", "pd", "link", "cache", "scheduler", "http", "ray")
        if loose := sorted(k for k, v in data.items() if not isinstance(v, dict)):
            raise ValueError(f"{path}: settings {loose} outside any table: the gateway's go under [serve]")
        if unknown_tables := sorted(set(data) - set(tables)):
            raise ValueError(f"{path}: unknown tables {unknown_tables} (known: {', '.join(tables)})")
        if inside := sorted(set(data.get("serve", {})) & set(tables)):  # [serve.pd], or pd = ... under [serve]
            raise ValueError(f"{path}: [serve] has no setting {inside[0]!r}: [{inside[0]}] is a table of its own, "
                             "at the top level of the file")  # fmt: skip
        top = dict(toml_values(path, "serve", cls, data.get("serve", {})))
        defaults = cls()
        for name in tables[1:]:
            if name in data:  # a table sets what it names; the rest keeps its default (worker counts included)
                table = getattr(defaults, name)
                top[name] = replace(table, **toml_values(path, name, type(table), data[name]))
        return cls(**top)


# a field's annotation -> the TOML values it takes (a bool is no number); any other is left to its config's checks
TOML_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "None": NoneType, "Args": dict}
TOML_NAMES = {"tuple[str, ...]": "a list of str", "Args": "a table"}  # a type in an error line


def toml_values(path: str | Path, table: str, config: type, values: dict) -> dict:
    """``values`` of a TOML table checked against ``config``'s fields, each known and of the field's type, so a
    wrong one is an error line, not a traceback later."""
    known = {f.name: str(f.type) for f in fields(config)}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"{path}: [{table}] has no setting {key!r} (known: {', '.join(sorted(known))})")
        kinds = [k.strip() for k in known[key].split("|")]
        if not any(_toml_fits(k, value) for k in kinds):
            named = " or ".join(TOML_NAMES.get(k, k) for k in kinds)
            raise ValueError(f"{path}: [{table}] {key} must be {named}, got {value!r}")
    return values


def _toml_fits(annotation: str, value: object) -> bool:
    """Whether a TOML value may go in a field annotated so."""
    if annotation == "tuple[str, ...]":  # a TOML array comes as a list
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    wanted = TOML_TYPES.get(annotation)
    return wanted is None or (isinstance(value, wanted) and (wanted is bool or not isinstance(value, bool)))
