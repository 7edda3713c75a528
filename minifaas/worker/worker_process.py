"""A worker: ``minifaas worker --role prefill|decode --cluster prfaas|pd --listen HOST:PORT``.

One per node, on any host. It loads the model, opens its KV port (decode: the
receiver; prefill with ``--accept-moves``: the one cache moves arrive on) and
its control port, and waits for a gateway: ``worker_session`` serves one at a
time, and a gateway that restarts attaches again to the same process.

    --listen        the control port the gateway dials
    --kv-listen     where the KV receiver listens (default: the --listen host, any port)
    --advertise     the KV address others are told to send to, for NAT and containers
                    (default: the --kv-listen address; a wildcard host means "the
                    address the gateway reached this worker at")

It prints one JSON line when ready (``{"control": [host, port], "kv": ..., "pid": ...}``)
and serves until SIGTERM or SIGINT; with ``--exit-with-stdin`` (how the gateway
starts its local children) it exits as soon as its stdin closes, so a gateway
that dies, however it dies, leaves none behind. The cluster secret comes from
``--secret-file`` or $MINIFAAS_SECRET, never from the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable

import torch

from minifaas.cache.pool import PoolConfig
from minifaas.codec.codec import codecs_for
from minifaas.config import NAME_PREFIX
from minifaas.control.secret import load_secret
from minifaas.control.server import ControlServer
from minifaas.model.batch_decoder import make_decoder
from minifaas.model.decoder import DecoderConfig
from minifaas.model.kernels import require_fast
from minifaas.model.loader import resolve_dtype
from minifaas.model.runtime import ModelRuntime
from minifaas.model.state_layout import needs_snapshot
from minifaas.model.warm_up import WarmUpPlan, warm_up
from minifaas.parent_watch import exit_when_stdin_closes
from minifaas.transport.receiver import KVReceiver, ReceiverConfig
from minifaas.worker.decode_prefix import DecodePrefixCache, JoiningReceiver
from minifaas.worker.decode_service import DecodeService
from minifaas.worker.gateway_session import WorkerNode, serve_gateway
from minifaas.worker.prefill_service import PrefillService
from minifaas.worker.prefix_store import PrefixStore

log = logging.getLogger("minifaas.worker")
WILDCARDS = ("", "0.0.0.0", "::")
READY = "waiting for a gateway"  # in the log line that says the worker is ready


def default_name(args: argparse.Namespace) -> str:
    tag = args.listen[1] or os.getpid()  # a fixed port names the node; an ephemeral one does not
    return f"{NAME_PREFIX[args.cluster, args.role]}-{socket.gethostname()}-{tag}"


def _advertised(args: argparse.Namespace, kv_host: str, kv_port: int) -> list:
    if args.advertise is None:
        return ["" if kv_host in WILDCARDS else kv_host, kv_port]
    host, _, port = args.advertise.rpartition(":") if ":" in args.advertise else (args.advertise, "", "")
    return [host.strip("[]"), int(port) if port else kv_port]


async def serve(args: argparse.Namespace, announce: Callable[[dict], None], stop: asyncio.Event | None = None) -> None:
    """Run the worker until ``stop`` is set (or stdin closes, with --exit-with-stdin)."""
    secret = load_secret(args.secret_file)
    name = args.name or default_name(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gpu_memory_fraction:  # before the weights: the caching allocator holds it from the first one
        torch.cuda.set_per_process_memory_fraction(args.gpu_memory_fraction, torch.device(args.device))
    dtype = resolve_dtype(args.dtype, args.device)
    runtime = await asyncio.to_thread(
        ModelRuntime.load, args.model, args.device, args.seed, dtype, args.trust_remote_code
    )
    require_fast(runtime.kernels, args.device, args.allow_slow_kernels)
    log.info("worker %s on %s: kernels %s", name, args.device, runtime.kernels.to_json())
    decoding = DecoderConfig(args.max_batch, args.step_tokens, args.max_waiting)
    plan = WarmUpPlan.for_worker(args.prefill_chunk, decoding.max_batch if args.role == "decode" else None)
    plan = plan if args.device.startswith("cuda") else plan.cpu_plan()  # nothing to compile on the CPU
    decoder = make_decoder(runtime, decoding) if args.role == "decode" else None  # a throwaway: same shapes
    log.info("worker %s warmed up: %s", name, await runtime.on_forward_thread(warm_up, runtime, plan, decoder))
    kv_host, kv_port = args.kv_listen or (args.listen[0], 0)
    codecs = codecs_for(args.kv_compression)
    measured: dict = {}  # a prefill worker's codecs, measured on a warm-up state
    async with contextlib.AsyncExitStack() as stack, asyncio.TaskGroup() as tg:
        kv, prefixes = None, None
        if args.role == "decode":  # on a GPU, states land in page-locked memory and move to it asynchronously
            pinned = args.device.startswith("cuda")
            config = ReceiverConfig(secret, host=kv_host, port=kv_port, codecs=codecs, pinned=pinned)
            receiver = await stack.enter_async_context(KVReceiver(config))
            kv = _advertised(args, kv_host, receiver.port)
            prefixes = DecodePrefixCache(
                _pool_config(args, runtime, name), runtime.spec.name, runtime.layout.kinds, name
            )
            joining = JoiningReceiver(receiver, prefixes, time.perf_counter)
            service: PrefillService | DecodeService = DecodeService(runtime, joining, args.state_timeout, decoding)  # type: ignore[arg-type]
            decode_loop = tg.create_task(service.run())
        else:
            moves = None
            if args.accept_moves:
                config = ReceiverConfig(secret, host=kv_host, port=kv_port, codecs=codecs)
                moves = await stack.enter_async_context(KVReceiver(config))
                kv = _advertised(args, kv_host, moves.port)
            store = PrefixStore(_pool_config(args, runtime, name), runtime.spec.name, runtime.layout.kinds, name)
            service = PrefillService(
                runtime, secret, args.connections, not args.no_pipelining, store, moves,
                chunk_tokens=args.prefill_chunk, codecs=codecs,
            )  # fmt: skip
            stack.push_async_callback(service.close)
            measured = await runtime.on_forward_thread(service.calibrate)
        node = WorkerNode(
            name,
            args.role,
            args.cluster,
            runtime.spec.name,
            service,
            prefixes,
            kv,
            os.getpid(),
            measured,
            runtime.kernels.label,
        )
        server = ControlServer(
            args.listen, secret, lambda session: serve_gateway(node, session, args.gateway_deadline),
            deadline_s=args.gateway_deadline,
        )  # fmt: skip
        await stack.enter_async_context(server)
        host = args.listen[0]
        announce({"control": [host, server.port], "kv": kv, "pid": node.pid, "name": name, "kernels": node.kernels})
        log.info("worker %s (%s %s, %s, %s kernels) %s on %s:%d; KV %s", name, args.cluster, args.role,
                 runtime.spec.name, node.kernels, READY, host, server.port,
                 "none" if kv is None else f"{kv[0] or '*'}:{kv[1]}")  # fmt: skip
        await (exit_when_stdin_closes() if args.exit_with_stdin else (stop or asyncio.Event()).wait())
        if args.role == "decode":
            decode_loop.cancel()


def _pool_config(args: argparse.Namespace, runtime: ModelRuntime, name: str) -> PoolConfig:
    """This node's pool, named after the node: the gateway tracks each node's pool apart."""
    return PoolConfig(
        name,
        int(args.cache_mib * (1 << 20)),
        args.cache_block_size,
        args.snapshot_interval,
        needs_snapshot(runtime.layout.kinds),
        enabled=args.prefix_cache != "none",
        snapshot_policy=args.snapshot_policy,
    )
