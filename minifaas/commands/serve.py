"""``minifaas serve``: start (or attach to) both clusters and the link between them, then serve the OpenAI API.

By default every worker is a child process on this host; ``--prfaas-worker`` / ``--pd-worker`` attach to
workers started by hand, and ``--launcher ray`` places them as Ray actors (docs/DEPLOY.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

from minifaas.cache.pool_config import PoolConfig
from minifaas.commands import arguments
from minifaas.commands.arguments import add_model_arguments
from minifaas.commands.main import BadInput, check_listen, exit_at_once, user_input
from minifaas.config import LOG_LEVELS, SNAPSHOT_POLICIES, ServeConfig
from minifaas.emulator.emulator_process import EmulatorError
from minifaas.gateway.dashboard import Dashboard
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.http_server import build_app, serve_http
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.roles import split_profiles
from minifaas.gateway.workers import cluster_secret
from minifaas.launch import forked
from minifaas.launch.launcher import WorkerError
from minifaas.launch.startup import StartupListener, StartupView
from minifaas.launch.worker_specs import planned_specs
from minifaas.model.loader import checked_spec
from minifaas.policy.codec_policy import MODES
from minifaas.policy.plugin import PolicyError
from minifaas.policy.short_term import ShortTermConfig
from minifaas.proctitle import set_title

log = logging.getLogger("minifaas.serve")
API_KEY_ENV = "MINIFAAS_API_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # hosts only this machine reaches
KERNEL_WORDS = {"fla": "fla kernels", "torch": "torch reference kernels", "none": "no linear-attention kernels"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # the flags default to None, so a --config file's settings stand unless a flag is given;
    # the defaults shown are ServeConfig's
    d, rules = ServeConfig(), ShortTermConfig()
    parser.add_argument(
        "--config",
        help="a TOML file ([serve], [prfaas], [pd], [link], [cache], [scheduler], [http], [ray]); flags override it "
        "(default: none)",
    )
    parser.add_argument("--host", help=f"address to listen on (default: {d.host})")
    parser.add_argument("--port", type=int, help=f"HTTP port; 0: any free one (default: {d.port})")
    add_model_arguments(parser, defaults=False)
    parser.add_argument(
        "--threshold", type=int, help=f"prompts longer than this go to PrfaaS, at start (default: {d.threshold})"
    )
    parser.add_argument(
        "--fixed-threshold", action="store_true", help="the short-term scheduler never moves t or the routing rule"
    )
    parser.add_argument(
        "--spill-tokens", type=int, metavar="N",
        help="a short prompt is prefilled on PrfaaS while PD-P's queue is N tokens longer than PrfaaS's and the link "
        f"has room; 0: never (default: {d.spill_tokens})",
    )  # fmt: skip
    parser.add_argument(
        "--max-link-backlog", type=arguments.non_negative, metavar="SECONDS", dest="max_link_backlog_s",
        help="a long prompt is prefilled on PD-P while the KV already routed across the link needs longer than this "
        f"to cross; 0: no bound (default: {d.max_link_backlog_s:g})",
    )  # fmt: skip
    parser.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on /v1/*; shows in ps: prefer ${API_KEY_ENV} (default: none, open)",
    )
    parser.add_argument(
        "--api-key-file", metavar="PATH", help="read the API key from the first line of PATH (default: none)"
    )
    parser.add_argument(
        "--first-token-timeout",
        type=float,
        help=f"seconds a request may wait for its first token (default: {d.first_token_timeout:g})",
    )
    parser.add_argument(
        "--token-timeout",
        type=float,
        help=f"seconds the output may pause between two tokens (default: {d.token_timeout:g})",
    )
    parser.add_argument("--request-timeout", type=float, help="seconds a whole request may take (default: no limit)")
    parser.add_argument(
        "--migration-limit",
        type=int,
        help="times a request may move to another decode worker after losing its own; 0: never (default: as "
        "often as its first-token and inter-token deadlines allow; a request that decode workers crash on twice "
        "just as they take it alone is stopped as their likely cause)",
    )
    parser.add_argument(
        "--max-connections", type=int, help=f"open HTTP connections; more get 503 (default: {d.http.max_connections})"
    )
    parser.add_argument(
        "--header-timeout", type=float, help=f"seconds to send a request's headers (default: {d.http.header_timeout:g})"
    )
    parser.add_argument(
        "--body-timeout", type=float, help=f"seconds to send a request's body (default: {d.http.body_timeout:g})"
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        help="seconds requests in flight have to finish once serve is told to stop (Ctrl-C, SIGTERM); then they "
        f"are cut, as they are at once by a second signal (default: {d.http.shutdown_grace:g})",
    )
    parser.add_argument(
        "--prfaas-workers", type=int, help=f"PrfaaS prefill workers (default: {d.prfaas.prefill_workers})"
    )
    parser.add_argument("--pd-prefill-workers", type=int, help=f"PD-P workers (default: {d.pd.prefill_workers})")
    parser.add_argument("--pd-decode-workers", type=int, help=f"PD-D workers (default: {d.pd.decode_workers})")
    parser.add_argument(
        "--max-batch",
        type=int,
        help="decode rows per forward; 1: unbatched; 0: what each decode worker's memory holds "
        f"(default: {d.pd.max_batch})",
    )
    parser.add_argument(
        "--prefill-chunk", type=int, help=f"prompt tokens per prefill forward; 0: one (default: {d.pd.prefill_chunk})"
    )
    parser.add_argument(
        "--prfaas-worker", action="append", type=_address, metavar="HOST:PORT",
        help="attach to a hand-started PrfaaS worker (repeat for more) (default: none, start them here)",
    )  # fmt: skip
    parser.add_argument(
        "--pd-worker", action="append", type=_address, metavar="HOST:PORT",
        help="attach to a hand-started PD worker, prefill or decode (repeat) (default: none, start them here)",
    )  # fmt: skip
    parser.add_argument(
        "--secret-file",
        help="the cluster secret, needed with remote workers (default: $MINIFAAS_SECRET, or a fresh one)",
    )
    parser.add_argument(
        "--launcher",
        choices=("local", "ray"),
        help=f"who starts the workers: child processes or Ray actors (default: {d.launcher})",
    )
    parser.add_argument(
        "--fork-workers", action=argparse.BooleanOptionalAction,
        help="fork local CPU workers from a parent that has imported torch and the model once, or start each "
        f"as a fresh interpreter (default: {'fork' if d.fork_workers else 'fresh'})",
    )  # fmt: skip
    parser.add_argument(
        "--ray-address",
        help=f"the Ray cluster for --launcher ray; 'local': start one on this host (default: {d.ray.address})",
    )
    parser.add_argument(
        "--link-emulator", action=argparse.BooleanOptionalAction,
        help="put the link emulator between the clusters (default: when every worker is a local child)",
    )  # fmt: skip
    arguments.add_device_arguments(parser)
    parser.add_argument(
        "--link-rate",
        type=arguments.rate,
        help=f"inter-cluster bandwidth, e.g. 100mbit, 10gbit, none (default: {d.link.rate})",
    )
    parser.add_argument(
        "--link-delay-ms",
        type=float,
        help=f"one-way delay of the link in ms; the RTT is twice it (default: {d.link.delay_ms:g})",
    )
    parser.add_argument(
        "--link-window",
        type=arguments.window,
        help=f"bytes in flight per connection, e.g. 4MiB (default: {d.link.window})",
    )
    parser.add_argument(
        "--connections", type=int, help=f"TCP connections per KV transfer (default: {d.link.connections})"
    )
    arguments.add_policy_arguments(
        parser, "kv-compression", "the codec of KV crossing the link: auto codes lossless only when the time it "
        "saves on the link exceeds the coding time; fp8/int8 are lossy, for attention KV, only when named",
        d.link.kv_compression, ", ".join(MODES),
    )  # fmt: skip
    parser.add_argument("--no-pipelining", action="store_true", help="send a state only when all layers are done")
    parser.add_argument("--prefix-cache", choices=("hybrid", "none"), help=f"prefix cache (default: {d.cache.mode})")
    parser.add_argument("--cache-block-size", type=int, help=f"tokens per cached block (default: {d.cache.block_size})")
    arguments.add_policy_arguments(
        parser, "snapshot-policy", "where linear-state snapshots go: reuse keeps them at prompt ends and at "
        "prefixes an earlier prompt shared; interval every --snapshot-interval blocks too",
        d.cache.snapshot_policy, ", ".join(SNAPSHOT_POLICIES),
    )  # fmt: skip
    parser.add_argument(
        "--snapshot-interval",
        type=int,
        help="the interval policy's blocks between state snapshots; 0: at prompt ends only "
        f"(default: {d.cache.snapshot_interval_blocks})",
    )
    parser.add_argument(
        "--cache-mib", type=float, help=f"prefix cache per prefill node in MiB (default: {d.cache.capacity_mib:g})"
    )
    parser.add_argument(
        "--no-incremental-transfer", action="store_true", help="ship the whole KV even if decode holds a prefix"
    )
    parser.add_argument("--no-cache-moves", action="store_true", help="never move a cache across the link first")
    parser.add_argument(
        "--route-rule",
        choices=("scarce", "abundant"),
        help="the routing rule to start with; the short-term scheduler then picks it from the link's use "
        f"(abundant while under {_percent(rules.abundant_below)} busy, scarce above {_percent(rules.scarce_above)}) "
        f"unless --fixed-threshold (default: {d.cache.rule})",
    )
    parser.add_argument(
        "--profile",
        help="an instance profile (minifaas profile --out): turns on re-planning and PD role conversion "
        "(default: none)",
    )
    parser.add_argument(
        "--rebalance-period", type=float, help=f"seconds between re-plans (default: {d.scheduler.period_s:g})"
    )
    parser.add_argument("--no-rebalance", action="store_true", help="never re-plan or change a PD worker's role")
    policies = parser.add_argument_group("policies (docs/POLICIES.md; each also a TOML key, its arguments a table)")
    arguments.add_policy_arguments(
        policies, "router", "where each request is prefilled and decoded", d.router, "default"
    )
    arguments.add_policy_arguments(
        policies, "short-term", "the threshold t and the routing rule, each second", d.scheduler.short_term, "default"
    )
    arguments.add_policy_arguments(
        policies, "long-term", "the P:D split, once a period (needs --profile)", d.scheduler.long_term, "default"
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        help="the least severe log lines shown, the gateway's and its workers' (default: INFO for the gateway, "
        f"{d.worker_log_level} for the workers)",
    )


def _percent(fraction: float) -> str:
    return f"{fraction:.0%}".replace("%", "%%")  # argparse formats help with %


# the settings a flag given sets: table -> {setting: the flag's dest}; "serve" is ServeConfig's own
FLAG_SETTINGS = {
    "serve": {name: name for name in ("host", "port", "model", "dtype", "threshold", "spill_tokens", "launcher",
                                      "max_link_backlog_s", "first_token_timeout", "token_timeout",
                                      "request_timeout", "migration_limit", "fork_workers", "secret_file")}
    | {"worker_log_level": "log_level"},
    "link": {"rate": "link_rate", "window": "link_window", "delay_ms": "link_delay_ms", "connections": "connections",
             "emulated": "link_emulator"},
    "cache": {"mode": "prefix_cache", "block_size": "cache_block_size", "snapshot_interval_blocks": "snapshot_interval",
              "capacity_mib": "cache_mib", "rule": "route_rule"},
    "http": {name: name for name in ("max_connections", "header_timeout", "body_timeout", "shutdown_grace")},
    "scheduler": {"profile": "profile", "period_s": "rebalance_period"},
    "ray": {"address": "ray_address"},
}  # fmt: skip
# store_true flags: dest -> (table, the setting it turns on, True, or off, False)
SWITCHES = {
    "trust_remote_code": ("serve", "trust_remote_code", True),
    "allow_slow_kernels": ("serve", "allow_slow_kernels", True),
    "fixed_threshold": ("serve", "fixed_threshold", True),
    "no_pipelining": ("link", "pipelined", False),
    "no_incremental_transfer": ("cache", "incremental_transfer", False),
    "no_cache_moves": ("cache", "cross_cluster_moves", False),
    "no_rebalance": ("scheduler", "rebalance", False),
}
# a policy's flag (--X SPEC, --X-arg KEY=VALUE): dest -> the table of its settings X and X_args
POLICY_TABLES = {"router": "serve", "short_term": "scheduler", "long_term": "scheduler", "kv_compression": "link",
                 "snapshot_policy": "cache"}  # fmt: skip


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The --config file's settings, each a flag gives replaced: a setting no flag names is kept whole."""
    base = ServeConfig.from_toml(args.config) if args.config else ServeConfig()
    if args.prfaas_device and args.prfaas_devices:
        raise ValueError("give --prfaas-device or --prfaas-devices, not both")
    if args.pd_device and args.pd_devices:
        raise ValueError("give --pd-device or --pd-devices, not both")
    counts = {
        "--prfaas-workers": (args.prfaas_workers, args.prfaas_worker, "--prfaas-worker"),
        "--pd-prefill-workers": (args.pd_prefill_workers, args.pd_worker, "--pd-worker"),
        "--pd-decode-workers": (args.pd_decode_workers, args.pd_worker, "--pd-worker"),
    }
    for flag, (count, hand_started, hand_flag) in counts.items():
        if count is not None and hand_started:  # a cluster's workers are all hand-started, or all started here
            raise ValueError(f"{flag} does not apply with {hand_flag}: the cluster's workers are the ones it names")
    prfaas = replace(
        base.prfaas,
        prefill_workers=_pick(
            args.prfaas_workers, len(args.prfaas_devices) if args.prfaas_devices else base.prfaas.prefill_workers
        ),
        decode_workers=0,
        device=_pick(args.prfaas_device, "cpu" if args.prfaas_devices else base.prfaas.device),
        prefill_chunk=_pick(args.prefill_chunk, base.prfaas.prefill_chunk),
        workers=_pick(args.prfaas_worker, base.prfaas.workers),
        dtype=None if args.dtype else base.prfaas.dtype,  # --dtype is for every cluster
        devices=_pick(args.prfaas_devices, base.prfaas.devices),
    )
    pd_prefill = _pick(args.pd_prefill_workers, base.pd.prefill_workers)
    pd_decode = max(1, len(args.pd_devices) - pd_prefill) if args.pd_devices else base.pd.decode_workers
    pd = replace(
        base.pd,
        prefill_workers=pd_prefill,
        decode_workers=_pick(args.pd_decode_workers, pd_decode),
        device=_pick(args.pd_device, "cpu" if args.pd_devices else base.pd.device),
        max_batch=_pick(args.max_batch, base.pd.max_batch),
        prefill_chunk=_pick(args.prefill_chunk, base.pd.prefill_chunk),
        workers=_pick(args.pd_worker, base.pd.workers),
        dtype=None if args.dtype else base.pd.dtype,
        devices=_pick(args.pd_devices, base.pd.devices),
    )
    if args.gpu_memory_fraction is not None:  # for the clusters on GPUs; one on the CPU has no share to set
        if prfaas.device == pd.device == "cpu":
            raise ValueError("--gpu-memory-fraction: no cluster runs on a GPU")
        prfaas, pd = (c if c.device == "cpu" else replace(c, memory_fraction=args.gpu_memory_fraction)
                      for c in (prfaas, pd))  # fmt: skip
    given = vars(args)
    changes = {table: {k: given[dest] for k, dest in flags.items() if given[dest] is not None}
               for table, flags in FLAG_SETTINGS.items()}  # fmt: skip
    for dest, (table, setting, on) in SWITCHES.items():
        if given[dest]:
            changes[table][setting] = on
    for dest, table in POLICY_TABLES.items():
        if given[dest] is not None:
            changes[table][dest] = given[dest]
        if given[dest] is not None or given[f"{dest}_arg"]:  # else the file's arguments stand
            changes[table][f"{dest}_args"] = given[f"{dest}_arg"] or ()
    tables = {name: replace(getattr(base, name), **c) for name, c in changes.items() if name != "serve"}
    return replace(base, **changes["serve"], api_key=_api_key(args, base.api_key), prfaas=prfaas, pd=pd, **tables)


def _address(text: str) -> str:
    arguments.host_port(text)  # a bad one is a usage error that says why
    return text


def _pick(flag: object, default: object) -> object:
    return default if flag is None else flag


def _api_key(args: argparse.Namespace, configured: str | None) -> str | None:
    """The key /v1/* requires, or None (open); one given empty is refused, not taken as no key."""
    if args.api_key is not None:
        if not args.api_key.strip():
            raise ValueError("--api-key is empty: give a key, or leave the flag out for an open server")
        return args.api_key
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read --api-key-file: {e}") from None
        if not lines or not lines[0].strip():
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return lines[0].strip()
    if configured is not None and not configured.strip():
        raise ValueError("[serve] api_key is empty: give a key, or leave the setting out for an open server")
    return os.environ.get(API_KEY_ENV) or configured


@contextlib.asynccontextmanager
async def running_server(
    config: ServeConfig, on_startup: StartupListener | None = None
) -> AsyncIterator[tuple[Gateway, int]]:
    """The gateway with its HTTP API listening; yields (gateway, bound port)."""
    metrics = ServeMetrics()
    async with Gateway(config, metrics, on_startup) as gateway:
        app = build_app(gateway, metrics, config.api_key, config.http)
        Dashboard.install(app, gateway, metrics)
        async with serve_http(app, config.host, config.port, config.http, metrics) as site:
            yield gateway, site.port


def checked_config(args: argparse.Namespace) -> ServeConfig:
    """The configuration, with what it names checked before any worker starts: model, devices, profile, port."""
    with user_input():
        config = config_from_args(args)
        checked_spec(config.model, config.trust_remote_code)
        for device in {d for c in (config.prfaas, config.pd) for d in (c.devices or (c.device,))}:
            arguments.present_device(device)
        planned_specs(config)  # a GPU the gateway's CUDA_VISIBLE_DEVICES does not show
        if config.scheduler.profile is not None:
            split_profiles(config)  # the PD instance's tables, and the PrfaaS one's if it has its own
        cluster_secret(config)  # a secret that is missing or too open
        c = config.cache  # the workers' snapshot policy, built once: a value its constructor refuses
        PoolConfig("", 0, c.block_size, c.snapshot_interval_blocks, snapshot_policy=c.snapshot_policy,
                   snapshot_args=c.snapshot_policy_args)  # fmt: skip
        if config.launcher == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("--launcher ray needs the ray extra: pip install 'minifaas[ray]'")
    if config.port:  # aiohttp would find the port taken only once every worker is up
        check_listen(config.host, config.port)
    return config


def kernels_line(gateway: Gateway) -> str:
    """What the workers' linear-attention layers run, in a few words: ``fla kernels``, or per worker where
    they differ (``fla kernels on prfaas-p0; torch reference kernels on pd-d0, pd-p0``)."""
    by_kernels: dict[str, list[str]] = {}
    for name, worker in sorted(gateway.pool.workers.items()):
        by_kernels.setdefault(KERNEL_WORDS.get(worker.kernels, f"{worker.kernels} kernels"), []).append(name)
    if len(by_kernels) == 1:
        return next(iter(by_kernels))
    return "; ".join(f"{words} on {', '.join(names)}" for words, names in sorted(by_kernels.items()))


def start_forks(config: ServeConfig) -> bool:
    """Before the event loop runs: the workers' pre-loaded parent, forked from this process once it has
    imported their modules, so that they are not imported twice. True if it was."""
    return config.forks_on_cpu_only and forked.start_here(config.model)


def log_to(console: Console, level: str) -> None:
    """Log lines at ``level`` and above: on a terminal printed above the live tables instead of through them."""
    if console.is_terminal:
        handler = RichHandler(console=console, show_path=False, markup=False)
        logging.basicConfig(level=level, format="%(name)s %(message)s", handlers=[handler])
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def run(args: argparse.Namespace) -> int:
    config = checked_config(args)
    forked_here = start_forks(config)
    console = Console(stderr=True)  # where the log goes
    log_to(console, args.log_level or "INFO")
    code = 0
    try:
        asyncio.run(_serve(config, StartupView(console, log.info)))
    except (WorkerError, EmulatorError) as e:  # a worker or link emulator that would not start: one line
        print(f"minifaas serve: {e}", file=sys.stderr)
        code = 1
    except PolicyError as e:  # a value a policy's constructor refuses, as the gateway builds it (before any worker)
        raise BadInput(str(e)) from None
    if forked_here:  # this process holds the workers' modules too
        exit_at_once(code)
    return code


async def _serve(config: ServeConfig, view: StartupView) -> None:
    stop = asyncio.Event()
    loop, serving = asyncio.get_running_loop(), asyncio.current_task()
    starting, cut = True, False

    def stopping() -> None:
        nonlocal cut
        if serving is not None and starting and not stop.is_set():  # a start waiting on its workers ends now
            serving.cancel()
        elif serving is not None and not starting and stop.is_set() and not cut:  # a second signal: no more grace
            cut = True
            serving.cancel()
        stop.set()

    def on_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping)

    on_signals()
    try:
        async with contextlib.AsyncExitStack() as stack:
            with view:
                gateway, port = await stack.enter_async_context(running_server(config, view))
            starting = False
            on_signals()  # again: starting Ray installs handlers of its own
            gc.collect()  # start-up's garbage in reference cycles is freed, not frozen with the rest
            gc.freeze()  # what start-up loaded lives as long as the process: full collections while serving skip it
            set_title("serve", f"{config.host}:{port}")
            log.info("serving %s on http://%s:%d/v1, %s (Ctrl-C to stop)", config.model, config.host, port,
                     kernels_line(gateway))  # fmt: skip
            if config.api_key is None and config.host not in LOOPBACK:
                log.warning("the API on %s takes requests from anyone who reaches it: no API key (--api-key-file, "
                            "$%s)", config.host, API_KEY_ENV)  # fmt: skip
            await stop.wait()
            log.info(
                "stopping: requests in flight have up to %g s to finish (a second Ctrl-C cuts them now), "
                "then the workers the gateway started and the link emulator stop",
                config.http.shutdown_grace,
            )
    except asyncio.CancelledError:
        if cut:
            log.info("stopped: the requests still in flight were cut")
        elif not (starting and stop.is_set()):
            raise
        else:
            log.info("stopped while starting: what had started is shut down")
