"""A worker process: ``python -m minifaas.serve.worker --role prefill|decode ...``.

Started by the gateway, one per node. It loads the model, opens its control
port (and, for decode, its KV receiver), prints one JSON line
``{"control_port": ..., "kv_port": ...}`` when ready (a prefill worker adds its
codecs measured on a warm-up state: ``"codecs"``), and serves the gateway's
one control connection. It exits when the gateway closes its stdin, so a
gateway that dies, however it dies, leaves no worker behind.

The KV secret comes from the MINIFAAS_KV_SECRET environment variable (hex),
never from the command line, where other users could read it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import traceback

from minifaas.cache.pool import PoolConfig
from minifaas.model.decoder import DecoderConfig
from minifaas.model.loader import DTYPE_CHOICES, resolve_dtype
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.model.state_layout import needs_snapshot
from minifaas.policy.compression import MODES
from minifaas.serve import control
from minifaas.serve.decode_prefix import DecodePrefixCache, JoiningReceiver
from minifaas.serve.decode_service import DecodeService
from minifaas.serve.prefill_service import PrefillService
from minifaas.serve.prefix_store import PrefixStore
from minifaas.transport import KVReceiver, ReceiverConfig, TransferError
from minifaas.transport.codec import codecs_for
from minifaas.transport.pool import DEFAULT_CONNECTIONS

log = logging.getLogger("minifaas.worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minifaas.serve.worker")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--trust-remote-code", action="store_true", help="let the checkpoint's own code run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-host", default="127.0.0.1", help="address the KV receiver listens on (decode)")
    p.add_argument("--kv-port", type=int, default=0, help="its port (0: any free one)")
    p.add_argument("--accept-moves", action="store_true", help="prefill: take cache moves in on a KV receiver")
    p.add_argument("--connections", type=int, default=DEFAULT_CONNECTIONS,
                   help=f"TCP connections per KV transfer (prefill; default {DEFAULT_CONNECTIONS})")  # fmt: skip
    p.add_argument("--no-pipelining", action="store_true", help="send a state only once every layer is done")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="TOKENS",
                   help="prefill: run a prompt in forwards of at most TOKENS, each one's full-attention KV "
                   "streamed as soon as it is made (0: one forward)")  # fmt: skip
    p.add_argument("--kv-compression", choices=MODES, default="auto",
                   help="KV codecs this worker sends with (prefill) or offers its senders (decode); the gateway "
                   "picks one per transfer. auto: none and lossless; fp8 or int8 add that lossy code")  # fmt: skip
    p.add_argument("--prefix-cache", choices=("hybrid", "none"), default="hybrid", help="this node's prefix cache")
    p.add_argument("--cache-block-size", type=int, default=32, help="tokens per cached full-attention block")
    p.add_argument("--snapshot-interval", type=int, default=4, help="blocks between state snapshots (0: ends only)")
    p.add_argument("--cache-mib", type=float, default=256.0, help="host memory for this node's prefix cache")
    p.add_argument("--state-timeout", type=float, default=60.0, help="seconds a decode waits for its state")
    d = DecoderConfig()
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="decode rows per forward (1: unbatched)")
    p.add_argument("--step-tokens", type=int, default=d.step_token_budget, help="KV slots a decode step may attend")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting, help="requests queued for a decode row")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    secret = bytes.fromhex(os.environ["MINIFAAS_KV_SECRET"])
    dtype = resolve_dtype(args.dtype, args.device)
    runtime = await asyncio.to_thread(
        ModelRuntime.load, args.model, args.device, args.seed, dtype, args.trust_remote_code
    )
    await asyncio.to_thread(runtime.generate, [0, 1, 2], SamplingParams(max_tokens=2))  # first forwards are slow
    codecs = codecs_for(args.kv_compression)
    ready: dict = {}
    async with contextlib.AsyncExitStack() as stack:
        kv_port = 0
        prefixes: DecodePrefixCache | None = None
        if args.role == "decode":
            receiver = await stack.enter_async_context(
                KVReceiver(ReceiverConfig(secret, host=args.kv_host, port=args.kv_port, codecs=codecs))
            )
            kv_port = receiver.port
            prefixes = _decode_prefixes(args, runtime)
            joining = JoiningReceiver(receiver, prefixes, time.perf_counter)
            decoding = DecoderConfig(args.max_batch, args.step_tokens, args.max_waiting)
            service: PrefillService | DecodeService = DecodeService(runtime, joining, args.state_timeout, decoding)  # type: ignore[arg-type]
        else:
            moves = None
            if args.accept_moves:
                config = ReceiverConfig(secret, host=args.kv_host, port=args.kv_port, codecs=codecs)
                moves = await stack.enter_async_context(KVReceiver(config))
                kv_port = moves.port
            store = _prefix_store(args, runtime)
            service = PrefillService(
                runtime, secret, args.connections, not args.no_pipelining, store, moves,
                chunk_tokens=args.prefill_chunk, codecs=codecs,
            )  # fmt: skip
            stack.push_async_callback(service.close)
            ready["codecs"] = await asyncio.to_thread(service.calibrate)
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future()
        )
        server = await asyncio.start_server(
            lambda r, w: connected.set_result((r, w)) if not connected.done() else w.close(),
            "127.0.0.1",
            0,
            limit=control.MAX_LINE,
        )
        async with server:
            port = server.sockets[0].getsockname()[1]
            ready |= {"control_port": port, "kv_port": kv_port, "pid": os.getpid()}
            print(json.dumps(ready), flush=True)
            reader, writer = await connected
            async with asyncio.TaskGroup() as tg:
                stdin_closed = tg.create_task(_wait_stdin_closed())
                if isinstance(service, DecodeService):
                    loop_task = tg.create_task(service.run())
                await _handle(service, reader, writer, tg, prefixes)
                stdin_closed.cancel()
                if isinstance(service, DecodeService):
                    loop_task.cancel()


def _pool_config(args: argparse.Namespace, runtime: ModelRuntime) -> PoolConfig:
    """This node's pool, named after the node: the gateway tracks each node's pool apart."""
    return PoolConfig(
        args.name,
        int(args.cache_mib * (1 << 20)),
        args.cache_block_size,
        args.snapshot_interval,
        needs_snapshot(runtime.layout.kinds),
        enabled=args.prefix_cache != "none",
    )


def _prefix_store(args: argparse.Namespace, runtime: ModelRuntime) -> PrefixStore:
    return PrefixStore(_pool_config(args, runtime), runtime.spec.name, runtime.layout.kinds, args.name)


def _decode_prefixes(args: argparse.Namespace, runtime: ModelRuntime) -> DecodePrefixCache:
    return DecodePrefixCache(_pool_config(args, runtime), runtime.spec.name, runtime.layout.kinds, args.name)


async def _handle(
    service: PrefillService | DecodeService,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    tg: asyncio.TaskGroup,
    prefixes: DecodePrefixCache | None = None,
) -> None:
    jobs: dict[str, asyncio.Task[None]] = {}
    aborted: set[str] = set()  # requests the gateway aborted whose job has not ended yet

    pool = service.store if isinstance(service, PrefillService) else prefixes

    def emit(message: dict) -> None:
        events = pool.drain_events() if pool is not None else []
        if events:  # the pool's changes go out before the news that follows them
            control.send(writer, {"op": "cache", "req": control.CACHE_EVENTS, "events": [e.to_json() for e in events]})
        control.send(writer, message)

    def failed(msg: dict, e: Exception) -> dict:
        return {"op": "failed", "req": msg["req"], "transfer": msg["transfer"], "error": f"{type(e).__name__}: {e}"}

    async def job(msg: dict) -> None:
        req = msg["req"]
        try:
            if isinstance(service, PrefillService):
                emit(await (service.export(msg) if msg["op"] == "export" else service.prefill(msg)))
            else:
                await service.decode(msg, emit)
        except asyncio.CancelledError:  # aborted by the gateway (or the worker is closing)
            if req in aborted and isinstance(service, PrefillService) and msg["op"] == "prefill":
                done = service.stopped_at.pop(req, 0)
                emit({"op": "aborted", "req": req, "tokens": len(msg["tokens"]), "done_tokens": done})
        except (TransferError, TimeoutError, OSError, ValueError, RuntimeError) as e:
            emit(failed(msg, e))
        except Exception as e:  # a bug: report it with its trace rather than leave the request hanging
            emit(failed(msg, e))
            traceback.print_exc()
        finally:
            aborted.discard(req)
            if prefixes is not None:
                prefixes.cancel(msg["transfer"])  # unpins a prefix whose state never arrived
            if jobs.get(req) is asyncio.current_task():
                del jobs[req]

    async for msg in control.messages(reader):
        op, req = msg["op"], msg.get("req", "")
        if op == "decode" and prefixes is not None and "tokens" in msg:
            pinned = prefixes.pin(msg["transfer"], msg["tokens"], msg.get("link_start", 0), time.perf_counter())
            if msg.get("link_start", 0):
                emit({"op": "pinned", "req": req, "transfer": msg["transfer"], "tokens": pinned})
        if op in ("prefill", "decode", "export"):
            jobs[req] = tg.create_task(job(msg))
        elif op == "start" and isinstance(service, DecodeService):
            service.start(req, msg["next_token"])
        elif op == "abort":
            if isinstance(service, DecodeService):
                service.abort(req)
            task = jobs.pop(req, None)
            if task is not None:  # a prefill stops at its next layer (PrefillService.prefill)
                aborted.add(req)
                task.cancel()
        elif op == "load":
            queued = service.queued_tokens if isinstance(service, PrefillService) else service.load
            emit({"op": "load", "req": req, "load": queued})
        await writer.drain()
    for task in jobs.values():
        task.cancel()


async def _wait_stdin_closed() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass
    log.info("gateway gone: exiting")
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
