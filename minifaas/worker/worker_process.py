"""A worker process: ``minifaas worker --role prefill|decode --cluster prfaas|pd --listen HOST:PORT``.

One per node. It loads and warms up the model, freezes that heap out of the garbage collector's full passes, opens
its KV and control ports, prints one JSON line when ready, and serves one gateway at a time until ``stop`` is set
or, with ``--exit-with-stdin``, until its stdin closes, so a gateway that dies leaves no worker behind. Its flags
are in ``commands/worker.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import logging
import os
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import torch

from minifaas.cache.pool_config import PoolConfig
from minifaas.codec.codec import Codec, codecs_for
from minifaas.config import NAME_PREFIX
from minifaas.control.secret import load_secret
from minifaas.control.server import ControlServer
from minifaas.control.session import Session
from minifaas.control.worker_ops import Attached
from minifaas.model.batch_decoder import make_decoder
from minifaas.model.decode_memory import sized_for
from minifaas.model.decoder import DecoderConfig
from minifaas.model.host_copy import HostCopier
from minifaas.model.kernels import require_fast
from minifaas.model.layer_state import ModelState
from minifaas.model.loader import resolve_dtype
from minifaas.model.runtime import ModelRuntime
from minifaas.model.state_layout import needs_snapshot
from minifaas.model.warm_up import WarmUpPlan, warm_up
from minifaas.parent_watch import exit_when_stdin_closes
from minifaas.transport.codec_probe import probe
from minifaas.transport.receiver import MAX_OPEN_TRANSFERS, KVReceiver, ReceiverConfig
from minifaas.worker.decode_service import DecodeService
from minifaas.worker.gateway_session import DecodeSession, PrefillSession, WorkerSession
from minifaas.worker.prefill_service import PrefillService
from minifaas.worker.prefix_store import DecodePrefixCache, PrefixStore

log = logging.getLogger("minifaas.worker")
WILDCARDS = ("", "0.0.0.0", "::")
READY = "waiting for a gateway"  # in the log line that says the worker is ready
CALIBRATION_PROMPT = [(37 * i + 11) % 256 for i in range(256)]  # token ids every preset's vocabulary holds


def default_name(args: argparse.Namespace) -> str:
    tag = args.listen[1] or os.getpid()  # a fixed port names the node; an ephemeral one does not
    return f"{NAME_PREFIX[args.cluster, args.role]}-{socket.gethostname()}-{tag}"


def _advertised(args: argparse.Namespace, kv_host: str, kv_port: int) -> list:
    """The KV address others are told to send to: ``--advertise`` (NAT, containers), else the one listened on,
    where a wildcard host becomes "" (the address the gateway reached this worker at)."""
    if args.advertise is None:
        return ["" if kv_host in WILDCARDS else kv_host, kv_port]
    host, port = args.advertise
    return [host, port or kv_port]


async def serve(args: argparse.Namespace, announce: Callable[[dict], None], stop: asyncio.Event | None = None) -> None:
    """Run the worker until ``stop`` is set (or stdin closes, with --exit-with-stdin)."""
    secret = load_secret(args.secret_file)
    name = args.name or default_name(args)
    runtime = await _load_runtime(args, name)
    await _warm_up(args, runtime, name)
    # what is loaded lives as long as the process: full collections while serving skip it (scanning it stalls a
    # forward); what loading and warming up left in reference cycles is freed first, not kept for good
    gc.collect()
    gc.freeze()
    async with contextlib.AsyncExitStack() as stack, asyncio.TaskGroup() as tg:
        build = _decode_side if args.role == "decode" else _prefill_side
        side = await build(args, runtime, name, secret, stack)
        decode_loop = tg.create_task(side.loop()) if side.loop is not None else None
        node = Attached(  # what this worker is, as it tells a gateway that attaches
            name=name,
            role=args.role,
            cluster=args.cluster,
            model=runtime.spec.name,
            max_batch=side.max_batch,
            kv=side.kv,
            pid=os.getpid(),
            codecs=side.codecs,
            kernels=runtime.kernels.label,
            deadline_s=args.gateway_deadline,
        )
        server = ControlServer(
            args.listen, secret, lambda session: side.session(node, session).serve(), deadline_s=args.gateway_deadline
        )
        await stack.enter_async_context(server)
        _announce(args, node, server.port, announce)
        await (exit_when_stdin_closes() if args.exit_with_stdin else (stop or asyncio.Event()).wait())
        if decode_loop is not None:
            decode_loop.cancel()


async def _load_runtime(args: argparse.Namespace, name: str) -> ModelRuntime:
    """The model on its device, with the kernels its role needs (or --allow-slow-kernels)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gpu_memory_fraction:  # before the weights: the caching allocator holds it from the first one
        torch.cuda.set_per_process_memory_fraction(args.gpu_memory_fraction, torch.device(args.device))
    dtype = resolve_dtype(args.dtype, args.device)
    runtime = await asyncio.to_thread(
        ModelRuntime.load, args.model, args.device, args.seed, dtype, args.trust_remote_code
    )
    require_fast(runtime.kernels, args.device, args.allow_slow_kernels)
    log.info("worker %s on %s: %s kernels", name, args.device, runtime.kernels.label)
    log.debug("worker %s: kernel bindings %s", name, runtime.kernels.to_json()["bindings"])
    return runtime


async def _warm_up(args: argparse.Namespace, runtime: ModelRuntime, name: str) -> None:
    """Run the shapes the worker will serve before it says it is ready; refuse, as at load, kernels that
    were bound to fla but ran the torch reference."""
    decoding = _decoding(args, runtime)
    plan = WarmUpPlan.for_worker(args.prefill_chunk, decoding.max_batch if args.role == "decode" else None)
    plan = plan if args.device.startswith("cuda") else plan.cpu_plan()  # nothing to compile on the CPU
    decoder = make_decoder(runtime, decoding) if args.role == "decode" else None  # a throwaway: same shapes
    log.info("worker %s warmed up: %s", name, await runtime.on_forward_thread(warm_up, runtime, plan, decoder))
    log.debug("worker %s: kernels that ran %s", name, runtime.kernels.to_json()["ran"])
    require_fast(runtime.kernels, args.device, args.allow_slow_kernels)


@dataclass(frozen=True, slots=True)
class Side:
    """A role's side of the worker: how it serves a gateway's session, the KV address it advertises, its codecs as
    measured, and, for a decode worker, the loop that steps its decoder and its rows per forward."""

    session: Callable[[Attached, Session], WorkerSession]
    kv: list | None
    codecs: dict
    loop: Callable[[], Coroutine[Any, Any, None]] | None = None
    max_batch: int | None = None


async def _decode_side(
    args: argparse.Namespace, runtime: ModelRuntime, name: str, secret: bytes, stack: contextlib.AsyncExitStack
) -> Side:
    """The KV receiver, the node's prefix cache joined onto it, and the decode service."""
    kv_host, kv_port = args.kv_listen or (args.listen[0], 0)
    decoding = _decoding(args, runtime)  # every request it may hold claims its transfer when the gateway sends it
    transfers = max(MAX_OPEN_TRANSFERS, decoding.max_batch + decoding.max_waiting)
    pinned = args.device.startswith("cuda")  # on a GPU, states land in page-locked memory, moved asynchronously
    codecs = codecs_for(args.kv_compression)
    config = ReceiverConfig(secret, kv_host, kv_port, codecs=codecs, pinned=pinned, max_open_transfers=transfers)
    receiver = await stack.enter_async_context(KVReceiver(config))
    prefixes = DecodePrefixCache(_pool_config(args, runtime, name), runtime.spec.name, runtime.layout.kinds, name)
    service = DecodeService(runtime, receiver, args.state_timeout, decoding, prefixes)
    kv = _advertised(args, kv_host, receiver.port)
    return Side(functools.partial(DecodeSession, service=service), kv, {}, service.run, service.max_batch)


async def _prefill_side(
    args: argparse.Namespace, runtime: ModelRuntime, name: str, secret: bytes, stack: contextlib.AsyncExitStack
) -> Side:
    """The receiver cache moves arrive on (with --accept-moves), the prefix store, the prefill service and its
    codecs, measured on a warm-up state."""
    kv_host, kv_port = args.kv_listen or (args.listen[0], 0)
    codecs = codecs_for(args.kv_compression)
    kv, moves = None, None
    if args.accept_moves:
        moves = await stack.enter_async_context(KVReceiver(ReceiverConfig(secret, kv_host, kv_port, codecs=codecs)))
        kv = _advertised(args, kv_host, moves.port)
    store = PrefixStore(_pool_config(args, runtime, name), runtime.spec.name, runtime.layout.kinds, name)
    service = PrefillService(
        runtime, secret, args.connections, not args.no_pipelining, store, moves,
        chunk_tokens=args.prefill_chunk, codecs=codecs, batch_tokens=args.prefill_batch,
    )  # fmt: skip
    stack.push_async_callback(service.close)
    measured = await runtime.on_forward_thread(calibrate, runtime, service.codecs)
    return Side(functools.partial(PrefillSession, service=service), kv, measured)


def calibrate(runtime: ModelRuntime, codecs: frozenset[Codec]) -> dict[str, list[float]]:
    """Each codec a prefill worker may use, measured once on the state of a real prefill: what the scheduler
    starts from (nbytes, wire bytes, encode s, decode s). Blocking: run it in a thread."""
    state = runtime.prefill(CALIBRATION_PROMPT).state
    copier = HostCopier(runtime.device)
    state = ModelState([copier.to_host(s) for s in state.layers], state.seq_len)
    return {c.label: probe(state, c).to_json() for c in sorted(codecs - {Codec.NONE})}


def _announce(args: argparse.Namespace, node: Attached, port: int, announce: Callable[[dict], None]) -> None:
    """The JSON line that says the worker is ready, and the log line."""
    host, kv = args.listen[0], node.kv
    announce({"control": [host, port], "kv": kv, "pid": node.pid, "name": node.name, "kernels": node.kernels})
    log.info("worker %s (%s %s, %s, %s kernels) %s on %s:%d; KV %s", node.name, args.cluster, args.role,
             node.model, node.kernels, READY, host, port,
             "none" if kv is None else f"{kv[0] or '*'}:{kv[1]}")  # fmt: skip


def _decoding(args: argparse.Namespace, runtime: ModelRuntime) -> DecoderConfig:
    """The decoder's bounds, those left at 0 sized for the memory this worker has (``decode_memory``), and its
    hold (-1: 1 on a CPU, where the prefills share the cores, 0 on a GPU)."""
    hold = args.decode_hold if args.decode_hold >= 0 else (0.0 if args.device.startswith("cuda") else 1.0)
    return sized_for(DecoderConfig(args.max_batch, args.step_tokens, args.max_waiting, hold), runtime)


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
        snapshot_args=args.snapshot_policy_arg or (),
    )
