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
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch

from minifaas import arguments
from minifaas.cache.pool import PoolConfig
from minifaas.cli import BadInput, user_input
from minifaas.cli import main as cli_main
from minifaas.control.secret import SECRET_ENV, load_secret
from minifaas.control.server import ControlServer
from minifaas.model.batch_decoder import make_decoder
from minifaas.model.decoder import DecoderConfig
from minifaas.model.kernels import require_fast
from minifaas.model.loader import add_model_arguments, resolve_dtype
from minifaas.model.runtime import ModelRuntime
from minifaas.model.state_layout import needs_snapshot
from minifaas.model.warm_up import WarmUpPlan, warm_up
from minifaas.parent_watch import die_with_parent, exit_when_stdin_closes
from minifaas.policy.compression import MODES
from minifaas.serve.config import SNAPSHOT_POLICIES
from minifaas.serve.decode_prefix import DecodePrefixCache, JoiningReceiver
from minifaas.serve.decode_service import DecodeService
from minifaas.serve.launch.launcher import NAME_PREFIX, parse_address
from minifaas.serve.prefill_service import PrefillService
from minifaas.serve.prefix_store import PrefixStore
from minifaas.serve.worker_session import WorkerNode, serve_gateway
from minifaas.transport import KVReceiver, ReceiverConfig
from minifaas.transport.codec import codecs_for
from minifaas.transport.pool import DEFAULT_CONNECTIONS

log = logging.getLogger("minifaas.worker")
WILDCARDS = ("", "0.0.0.0", "::")
READY = "waiting for a gateway"  # in the log line that says the worker is ready


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=("prefill", "decode"), required=True, help="what this worker does")
    p.add_argument("--cluster", choices=("prfaas", "pd"), required=True, help="the cluster this worker serves in")
    p.add_argument("--name", help="this node's name in routing and metrics (default: cluster-role-host-port)")
    p.add_argument("--listen", type=parse_address, default=("127.0.0.1", 0), metavar="HOST:PORT",
                   help="the control port the gateway dials (default: 127.0.0.1:0, any free port)")  # fmt: skip
    p.add_argument("--kv-listen", type=parse_address, metavar="HOST:PORT",
                   help="where the KV receiver listens (default: the --listen host, any free port)")  # fmt: skip
    p.add_argument("--advertise", metavar="HOST[:PORT]",
                   help="the KV address others are told to use (NAT, containers; default: --kv-listen)")  # fmt: skip
    p.add_argument("--secret-file", help=f"file holding the cluster secret (default: ${SECRET_ENV})")
    p.add_argument("--gateway-deadline", type=float, default=30.0, metavar="S",
                   help="drop a gateway silent for S seconds, so another may attach (default: 30)")  # fmt: skip
    p.add_argument("--exit-with-stdin", action="store_true", help="exit when stdin closes (the gateway's children)")
    add_model_arguments(p)
    p.add_argument("--device", type=arguments.device, default="cpu", help="cpu or cuda:N (default: cpu)")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.0, metavar="F",
                   help="the share of its GPU's memory this worker may take, where workers share one; "
                   "0: no limit (default: 0)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="of a preset's random weights (default: 0)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads; 0: torch's default, one per core it may use (default: 0)")  # fmt: skip
    p.add_argument("--allow-slow-kernels", action="store_true",
                   help="on CUDA, start even without flash-linear-attention (torch reference kernels)")  # fmt: skip
    p.add_argument("--accept-moves", action="store_true", help="prefill: take cache moves in on a KV receiver")
    p.add_argument("--connections", type=int, default=DEFAULT_CONNECTIONS,
                   help=f"TCP connections per KV transfer (prefill; default: {DEFAULT_CONNECTIONS})")  # fmt: skip
    p.add_argument("--no-pipelining", action="store_true", help="send a state only once every layer is done")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="TOKENS",
                   help="prefill: run a prompt in forwards of at most TOKENS, each one's full-attention KV "
                   "streamed as soon as it is made; 0: one forward (default: 512)")  # fmt: skip
    p.add_argument("--kv-compression", choices=MODES, default="auto",
                   help="KV codecs this worker sends with (prefill) or offers its senders (decode); the gateway "
                   "picks one per transfer. auto: none and lossless; fp8 or int8 add that lossy code "
                   "(default: auto)")  # fmt: skip
    p.add_argument("--prefix-cache", choices=("hybrid", "none"), default="hybrid",
                   help="this node's prefix cache (default: hybrid)")  # fmt: skip
    p.add_argument("--cache-block-size", type=int, default=32,
                   help="tokens per cached full-attention block (default: 32)")  # fmt: skip
    p.add_argument("--snapshot-policy", choices=SNAPSHOT_POLICIES, default="reuse",
                   help="where state snapshots go: prompt ends and prefixes another prompt shared (reuse), or "
                   "every --snapshot-interval blocks too (default: reuse)")  # fmt: skip
    p.add_argument("--snapshot-interval", type=int, default=4,
                   help="the interval policy's blocks between state snapshots; 0: at prompt ends only "
                   "(default: 4)")  # fmt: skip
    p.add_argument("--cache-mib", type=float, default=256.0,
                   help="host memory for this node's prefix cache in MiB (default: 256)")  # fmt: skip
    p.add_argument("--state-timeout", type=float, default=60.0,
                   help="seconds a decode waits for its state (default: 60)")  # fmt: skip
    d = DecoderConfig()
    p.add_argument("--max-batch", type=int, default=d.max_batch,
                   help=f"decode rows per forward; 1: unbatched (default: {d.max_batch})")  # fmt: skip
    p.add_argument("--step-tokens", type=int, default=d.step_token_budget,
                   help=f"KV slots a decode step may attend (default: {d.step_token_budget})")  # fmt: skip
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help=f"requests queued for a decode row (default: {d.max_waiting})")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="minifaas worker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser.parse_args(argv)


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


def _print_ready(ready: dict) -> None:
    print(json.dumps(ready), flush=True)


async def _until_signalled(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await serve(args, _print_ready, stop)


def run(args: argparse.Namespace) -> int:
    with user_input():  # one error line, before the model loads
        load_secret(args.secret_file)
        arguments.present_device(args.device)
        if not 0 <= args.gpu_memory_fraction <= 1 or (args.gpu_memory_fraction and args.device == "cpu"):
            raise ValueError(f"--gpu-memory-fraction {args.gpu_memory_fraction}: a share in [0, 1] of a GPU")
    for host, port in {args.listen, args.kv_listen or args.listen}:
        if port:
            try:  # the model would load for seconds before the bind failed
                socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
            except OSError as e:
                raise BadInput(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    die_with_parent()  # a child of the gateway: killed with it, however it dies
    asyncio.run(_until_signalled(args))
    return 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(cli_main(["worker", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    main()
