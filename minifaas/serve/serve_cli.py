"""``minifaas serve``: start both clusters and the link between them, then serve the OpenAI API."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import replace

from aiohttp import web

from minifaas.serve.api import build_app
from minifaas.serve.config import CacheConfig, ClusterConfig, LinkConfig, ServeConfig
from minifaas.serve.gateway import Gateway
from minifaas.serve.metrics import ServeMetrics

log = logging.getLogger("minifaas.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    parser.add_argument(
        "--config", help="a TOML file ([serve], [prfaas], [pd], [link], [cache], [scheduler]); flags override it"
    )
    parser.add_argument("--host", help=f"address to listen on (default {d.host})")
    parser.add_argument("--port", type=int, help=f"HTTP port (default {d.port})")
    parser.add_argument("--model", help=f"preset or local checkpoint dir (default {d.model})")
    parser.add_argument("--threshold", type=int, help=f"prompts longer than this go PrfaaS (default {d.threshold})")
    parser.add_argument("--fixed-threshold", action="store_true", help="the scheduler never moves t or the rule")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--prfaas-workers", type=int, help="PrfaaS prefill workers (default 1)")
    parser.add_argument("--pd-prefill-workers", type=int, help="PD-P workers (default 1)")
    parser.add_argument("--pd-decode-workers", type=int, help="PD-D workers (default 1)")
    parser.add_argument("--max-batch", type=int, help=f"decode rows per forward, 1: unbatched ({d.pd.max_batch})")
    parser.add_argument(
        "--prefill-chunk", type=int, help=f"prompt tokens per prefill forward, 0: one (default {d.pd.prefill_chunk})"
    )
    parser.add_argument("--prfaas-device", help="cpu or cuda:N for the PrfaaS cluster")
    parser.add_argument("--pd-device", help="cpu or cuda:N for the PD cluster")
    parser.add_argument("--link-rate", help="inter-cluster bandwidth, e.g. 100mbit, 10gbit, none")
    parser.add_argument("--link-delay-ms", type=float, help="one-way delay of the link")
    parser.add_argument("--connections", type=int, help="TCP connections per KV transfer")
    parser.add_argument("--no-pipelining", action="store_true", help="send a state only when all layers are done")
    parser.add_argument("--prefix-cache", choices=("hybrid", "none"), help=f"prefix cache (default {d.cache.mode})")
    parser.add_argument("--cache-block-size", type=int, help=f"tokens per cached block (default {d.cache.block_size})")
    parser.add_argument(
        "--snapshot-interval",
        type=int,
        help=f"blocks between state snapshots; 0: at prompt ends only (default {d.cache.snapshot_interval_blocks})",
    )
    parser.add_argument(
        "--cache-mib", type=float, help=f"prefix cache per prefill node (default {d.cache.capacity_mib})"
    )
    parser.add_argument(
        "--no-incremental-transfer", action="store_true", help="ship the whole KV even if decode holds a prefix"
    )
    parser.add_argument("--no-cache-moves", action="store_true", help="never move a cache across the link first")
    parser.add_argument("--route-rule", choices=("scarce", "abundant"), help=f"routing rule (default {d.cache.rule})")
    parser.add_argument(
        "--profile", help="an instance profile (minifaas profile --out): turns on re-planning and PD role conversion"
    )
    parser.add_argument(
        "--rebalance-period", type=float, help=f"seconds between re-plans (default {d.scheduler.period_s})"
    )
    parser.add_argument("--no-rebalance", action="store_true", help="never re-plan or change a PD worker's role")
    parser.add_argument("--log-level", default="INFO")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    base = ServeConfig.from_toml(args.config) if args.config else ServeConfig()
    prfaas = ClusterConfig(
        _pick(args.prfaas_workers, base.prfaas.prefill_workers),
        0,
        _pick(args.prfaas_device, base.prfaas.device),
        prefill_chunk=_pick(args.prefill_chunk, base.prfaas.prefill_chunk),
    )
    pd = ClusterConfig(
        _pick(args.pd_prefill_workers, base.pd.prefill_workers),
        _pick(args.pd_decode_workers, base.pd.decode_workers),
        _pick(args.pd_device, base.pd.device),
        _pick(args.max_batch, base.pd.max_batch),
        _pick(args.prefill_chunk, base.pd.prefill_chunk),
    )
    link = LinkConfig(
        rate=_pick(args.link_rate, base.link.rate),
        flow_rate=base.link.flow_rate,
        delay_ms=_pick(args.link_delay_ms, base.link.delay_ms),
        jitter_ms=base.link.jitter_ms,
        connections=_pick(args.connections, base.link.connections),
        pipelined=base.link.pipelined and not args.no_pipelining,
    )
    cache = CacheConfig(
        mode=_pick(args.prefix_cache, base.cache.mode),
        block_size=_pick(args.cache_block_size, base.cache.block_size),
        snapshot_interval_blocks=_pick(args.snapshot_interval, base.cache.snapshot_interval_blocks),
        capacity_mib=_pick(args.cache_mib, base.cache.capacity_mib),
        rule=_pick(args.route_rule, base.cache.rule),
        incremental_transfer=base.cache.incremental_transfer and not args.no_incremental_transfer,
        cross_cluster_moves=base.cache.cross_cluster_moves and not args.no_cache_moves,
    )
    scheduler = replace(
        base.scheduler,
        profile=_pick(args.profile, base.scheduler.profile),
        period_s=_pick(args.rebalance_period, base.scheduler.period_s),
        rebalance=base.scheduler.rebalance and not args.no_rebalance,
    )
    return ServeConfig(
        host=_pick(args.host, base.host),
        port=_pick(args.port, base.port),
        model=_pick(args.model, base.model),
        seed=base.seed,
        threshold=_pick(args.threshold, base.threshold),
        fixed_threshold=args.fixed_threshold or base.fixed_threshold,
        api_key=_pick(args.api_key, base.api_key),
        request_timeout=base.request_timeout,
        prefill_timeout=base.prefill_timeout,
        max_queued_requests=base.max_queued_requests,
        prfaas=prfaas,
        pd=pd,
        link=link,
        cache=cache,
        scheduler=scheduler,
    )


def _pick(flag: object, default: object) -> object:
    return default if flag is None else flag


@contextlib.asynccontextmanager
async def running_server(config: ServeConfig) -> AsyncIterator[tuple[Gateway, int]]:
    """The gateway with its HTTP API listening; yields (gateway, bound port)."""
    metrics = ServeMetrics()
    async with Gateway(config, metrics) as gateway:
        runner = web.AppRunner(
            build_app(gateway, metrics, config.api_key), handle_signals=False, handler_cancellation=True
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, config.host, config.port)
            await site.start()
            port = runner.addresses[0][1]
            yield gateway, port
        finally:
            await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = config_from_args(args)
    asyncio.run(_serve(config))
    return 0


async def _serve(config: ServeConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running_server(config) as (_, port):
        log.info("serving %s on http://%s:%d/v1 (Ctrl-C to stop)", config.model, config.host, port)
        await stop.wait()
        log.info("stopping: workers and the link emulator are shut down")
