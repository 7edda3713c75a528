"""``minifaas worker``: one prefill or decode worker's flags, then the worker (``worker/worker_process.py``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading

from minifaas.cache.pool_config import PoolConfig
from minifaas.commands import arguments
from minifaas.commands.arguments import add_model_arguments
from minifaas.commands.main import check_listen, user_input
from minifaas.commands.main import main as cli_main
from minifaas.config import LOG_LEVELS, SNAPSHOT_POLICIES
from minifaas.control.secret import SECRET_ENV, load_secret
from minifaas.model.decode_memory import MAX_ROWS
from minifaas.model.decoder import DecoderConfig
from minifaas.net.connections import DEFAULT_CONNECTIONS, MAX_CONNECTIONS
from minifaas.parent_watch import die_with_parent
from minifaas.policy.codec_policy import MODES
from minifaas.proctitle import set_title
from minifaas.worker.worker_process import serve


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=("prefill", "decode"), required=True, help="what this worker does")
    p.add_argument("--cluster", choices=("prfaas", "pd"), required=True, help="the cluster this worker serves in")
    p.add_argument("--name", help="this node's name in routing and metrics (default: cluster-role-host-port)")
    p.add_argument("--listen", type=arguments.host_port, default=("127.0.0.1", 0), metavar="HOST:PORT",
                   help="the control port the gateway dials (default: 127.0.0.1:0, any free port)")  # fmt: skip
    p.add_argument("--kv-listen", type=arguments.host_port, metavar="HOST:PORT",
                   help="where the KV receiver listens (default: the --listen host, any free port)")  # fmt: skip
    p.add_argument("--advertise", type=arguments.advertised, metavar="HOST[:PORT]",
                   help="the KV address others are told to use (NAT, containers; default: --kv-listen)")  # fmt: skip
    p.add_argument("--secret-file", help=f"file holding the cluster secret (default: ${SECRET_ENV})")
    p.add_argument("--gateway-deadline", type=arguments.positive, default=30.0, metavar="S",
                   help="drop a gateway silent for S seconds, so another may attach (default: 30)")  # fmt: skip
    p.add_argument("--exit-with-stdin", action="store_true", help="exit when stdin closes (the gateway's children)")
    add_model_arguments(p)
    p.add_argument("--device", type=arguments.device, default="cpu", help="cpu or cuda:N (default: cpu)")
    p.add_argument("--gpu-memory-fraction", type=arguments.fraction, default=0.0, metavar="F",
                   help="the share of its GPU's memory this worker may take, where workers share one; "
                   "0: no limit (default: 0)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="of a preset's random weights (default: 0)")
    p.add_argument("--threads", type=arguments.count, default=0,
                   help="torch threads; 0: torch's default, one per core it may use (default: 0)")  # fmt: skip
    p.add_argument("--allow-slow-kernels", action="store_true",
                   help="on CUDA, start even without flash-linear-attention (torch reference kernels)")  # fmt: skip
    p.add_argument("--accept-moves", action="store_true", help="prefill: take cache moves in on a KV receiver")
    p.add_argument("--connections", type=arguments.positive_int, default=DEFAULT_CONNECTIONS,
                   help=f"TCP connections per KV transfer (prefill; default: {DEFAULT_CONNECTIONS})")  # fmt: skip
    p.add_argument("--no-pipelining", action="store_true", help="send a state only once every layer is done")
    p.add_argument("--prefill-chunk", type=arguments.count, default=512, metavar="TOKENS",
                   help="prefill: run a prompt in forwards of at most TOKENS, each one's full-attention KV "
                   "streamed as soon as it is made; 0: one forward (default: 512)")  # fmt: skip
    p.add_argument("--prefill-batch", type=arguments.count, default=512, metavar="TOKENS",
                   help="prefill: prompts of one length queued at once, none with a cached prefix, run as the rows "
                   "of one forward of at most TOKENS; 0: one prompt per forward (default: 512)")  # fmt: skip
    p.add_argument("--kv-compression", choices=MODES, default="auto",
                   help="KV codecs this worker sends with (prefill) or offers its senders (decode); the gateway "
                   "picks one per transfer. auto: none and lossless; fp8 or int8 add that lossy code "
                   "(default: auto)")  # fmt: skip
    p.add_argument("--prefix-cache", choices=("hybrid", "none"), default="hybrid",
                   help="this node's prefix cache (default: hybrid)")  # fmt: skip
    p.add_argument("--cache-block-size", type=arguments.positive_int, default=32,
                   help="tokens per cached full-attention block (default: 32)")  # fmt: skip
    arguments.add_policy_arguments(p, "snapshot-policy", "where state snapshots go: prompt ends and prefixes another "
                                   "prompt shared (reuse), or every --snapshot-interval blocks too (interval)",
                                   "reuse", ", ".join(SNAPSHOT_POLICIES))  # fmt: skip
    p.set_defaults(snapshot_policy="reuse")
    p.add_argument("--snapshot-interval", type=arguments.count, default=4,
                   help="the interval policy's blocks between state snapshots; 0: at prompt ends only "
                   "(default: 4)")  # fmt: skip
    p.add_argument("--cache-mib", type=arguments.non_negative, default=256.0,
                   help="host memory for this node's prefix cache in MiB (default: 256)")  # fmt: skip
    p.add_argument("--state-timeout", type=arguments.non_negative, default=0.0,
                   help="seconds a decode waits for its state, and then for its first token; 0: no limit of its "
                   "own, since the gateway aborts a request past its first-token deadline (default: 0)")  # fmt: skip
    p.add_argument("--decode-hold", type=float, default=-1.0, metavar="X",
                   help="decode: while more requests are on their way than it decodes, hold each step back by X "
                   "times the last one's length (at most 0.05 s), so more rows share it and the prefills they wait "
                   "for get the cores; 0: step back to back; -1: 1 on a CPU, 0 on a GPU (default: -1)")  # fmt: skip
    d = DecoderConfig()
    p.add_argument("--max-batch", type=arguments.count, default=d.max_batch,
                   help="decode rows per forward; 1: unbatched; 0: what this worker's memory holds, at most "
                   f"{MAX_ROWS} (default: {d.max_batch})")  # fmt: skip
    p.add_argument("--step-tokens", type=arguments.count, default=d.step_token_budget,
                   help="KV slots a decode step may attend, padding included; 0: what this worker's memory "
                   f"holds (default: {d.step_token_budget})")  # fmt: skip
    p.add_argument("--max-waiting", type=arguments.count, default=d.max_waiting,
                   help=f"requests queued for a decode row (default: {d.max_waiting})")  # fmt: skip
    p.add_argument("--log-level", type=str.upper, default="INFO", choices=LOG_LEVELS,
                   help="the least severe log lines shown; a gateway starts its own workers at WARNING "
                   "(serve --log-level) (default: INFO)")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """A worker's flags as ``minifaas worker`` reads them (a Ray actor's worker reads them so)."""
    parser = argparse.ArgumentParser(
        prog="minifaas worker", description="one prefill or decode worker, waiting for a gateway"
    )
    add_arguments(parser)
    return parser.parse_args(argv)


def _role(args: argparse.Namespace) -> str:
    """The first word of the worker's process title: ``prfaas-prefill``, ``pd-decode``."""
    return f"{args.cluster}-{args.role}"


async def _until_signalled(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)

    def announce(ready: dict) -> None:
        set_title(_role(args), ready["name"], f":{ready['control'][1]}")  # its name and control port, in ps
        try:
            print(json.dumps(ready), flush=True)
        except BrokenPipeError:  # whoever started it left before it was ready: no one will attach, so stop
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115  # the interpreter flushes it once more at exit
            stop.set()

    await serve(args, announce, stop)


def run(args: argparse.Namespace) -> int:
    with user_input():  # one error line, before the model loads
        if args.cluster == "prfaas" and args.role == "decode":
            raise ValueError("the PrfaaS cluster only prefills: --role decode needs --cluster pd")
        if args.connections > MAX_CONNECTIONS:
            raise ValueError(f"--connections {args.connections}: at most {MAX_CONNECTIONS} per transfer")
        if args.decode_hold < 0 and args.decode_hold != -1:
            raise ValueError(f"--decode-hold {args.decode_hold}: a factor >= 0, or -1 for the device's default")
        load_secret(args.secret_file)
        arguments.present_device(args.device)
        PoolConfig("", 0, args.cache_block_size, args.snapshot_interval,  # its snapshot policy built once
                   snapshot_policy=args.snapshot_policy, snapshot_args=args.snapshot_policy_arg or ())  # fmt: skip
        if not 0 <= args.gpu_memory_fraction <= 1 or (args.gpu_memory_fraction and args.device == "cpu"):
            raise ValueError(f"--gpu-memory-fraction {args.gpu_memory_fraction}: a share in [0, 1] of a GPU")
    for host, port in {args.listen, args.kv_listen or args.listen}:
        if port:  # the model would load for seconds before the bind failed
            check_listen(host, port)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    die_with_parent()  # a child of the gateway: killed with it, however it dies
    set_title(_role(args), args.name)  # until it is ready and knows its control port
    asyncio.run(_until_signalled(args))
    return 0


if __name__ == "__main__":  # errors as ``minifaas worker`` gives them, one line
    sys.exit(cli_main(["worker", *sys.argv[1:]]))
