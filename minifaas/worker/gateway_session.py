"""One gateway's session with a worker: control messages in, the worker's replies out.

A worker serves one gateway at a time (``control.server`` refuses a second).
On ``attach`` it says what it is (name, role, cluster, model, KV address, pid)
and sends its pool's inventory, so a gateway that restarted learns what the
node already holds; nothing else about the worker changes.

Every message is checked against ``WORKER_OPS`` first; one it does not allow,
or one whose handling raises, is answered ``{"op": "error"}`` and the session
goes on. Each request runs as a task of the session. When the session ends
(the gateway closed it, went silent past the deadline, or sent a frame that
failed its MAC), every request it started is aborted: a prefill stops, a
decode row is freed, and nothing is left waiting for a gateway that is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import traceback
from dataclasses import dataclass

from minifaas.cache.pool import HybridPrefixPool
from minifaas.control.schema import BadMessage, validate
from minifaas.control.session import ControlError, Garbled, Session
from minifaas.control.worker_ops import CACHE_EVENTS, WORKER_OPS
from minifaas.net.errors import TransferError
from minifaas.worker.decode_prefix import DecodePrefixCache
from minifaas.worker.decode_service import DecodeService
from minifaas.worker.prefill_service import PrefillService

log = logging.getLogger("minifaas.worker")
INVENTORY_BATCH = 1000  # cache events per message when a gateway attaches


@dataclass(slots=True)
class WorkerNode:
    """What a worker is and serves, for as long as the process runs."""

    name: str
    role: str
    cluster: str
    model: str
    service: PrefillService | DecodeService
    prefixes: DecodePrefixCache | None  # a decode node's received KV
    kv: list | None  # [host, port] others send KV to ("" host: the address the gateway reached us at)
    pid: int
    codecs: dict  # a prefill worker's codecs as measured at start: name -> [bytes, wire bytes, encode s, decode s]
    kernels: str = "unknown"  # what its linear-attention layers run: fla, torch (the reference) or none

    @property
    def pool(self) -> HybridPrefixPool | None:
        return (
            self.service.store.pool
            if isinstance(self.service, PrefillService)
            else self.prefixes and self.prefixes.pool
        )

    def describe(self) -> dict:
        fields = {"name": self.name, "role": self.role, "cluster": self.cluster, "model": self.model}
        return {**fields, "kv": self.kv, "pid": self.pid, "codecs": self.codecs, "kernels": self.kernels}


async def serve_gateway(node: WorkerNode, session: Session, deadline_s: float) -> None:
    jobs: dict[str, asyncio.Task[None]] = {}
    aborted: set[str] = set()  # requests the gateway aborted whose job has not ended yet
    decoding: set[str] = set()  # requests of this session handed to the decode service
    service, prefixes = node.service, node.prefixes

    def send(message: dict) -> None:
        if not session.closed:  # after the session ended its requests answer no one
            session.send(message)

    def send_cache_events() -> None:
        if node.pool is not None and (events := node.pool.drain_events()):
            send({"op": "cache", "req": CACHE_EVENTS, "events": [e.to_json() for e in events]})

    def emit(message: dict) -> None:
        send_cache_events()  # the pool's changes go out before the news that follows them
        send(message)

    if isinstance(service, PrefillService):
        service.kept = send_cache_events  # a prompt's blocks are stored after its reply: their news follows

    def failed(msg: dict, e: BaseException) -> dict:
        return {"op": "failed", "req": msg["req"], "transfer": msg["transfer"], "error": f"{type(e).__name__}: {e}"}

    async def job(msg: dict) -> None:
        req = msg["req"]
        try:
            if isinstance(service, PrefillService):
                emit(await (service.export(msg) if msg["op"] == "export" else service.prefill(msg, send)))
            else:
                await service.decode(msg, emit)
        except asyncio.CancelledError:  # aborted by the gateway, or the session is over
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

    def handle(op: str, msg: dict, tg: asyncio.TaskGroup) -> None:
        req = msg.get("req", "")
        if op == "attach":
            send({"op": "attached", **node.describe(), "deadline_s": deadline_s})
            events = node.pool.inventory(time.perf_counter()) if node.pool is not None else []
            for i in range(0, len(events), INVENTORY_BATCH):
                batch = [e.to_json() for e in events[i : i + INVENTORY_BATCH]]
                send({"op": "cache", "req": CACHE_EVENTS, "events": batch})
        elif op == "ping":
            send({"op": "pong", **_link_report(service)})
        elif op in ("prefill", "decode", "export"):
            if (op == "decode") != isinstance(service, DecodeService):
                raise BadMessage(f"a {node.role} worker does not {op}")
            if req in jobs:
                raise BadMessage(f"request {req!r} is already running")
            if op == "decode" and prefixes is not None:
                pinned = prefixes.pin(msg["transfer"], msg["tokens"], msg["link_start"], time.perf_counter())
                if msg["link_start"]:
                    emit({"op": "pinned", "req": req, "transfer": msg["transfer"], "tokens": pinned})
            if op == "decode":
                decoding.add(req)
            jobs[req] = tg.create_task(job(msg))
        elif op == "start" and isinstance(service, DecodeService):
            service.start(req, msg["next_token"])
        elif op == "abort":
            if isinstance(service, DecodeService):
                service.abort(req)
                decoding.discard(req)
            task = jobs.pop(req, None)
            if task is not None:  # a prefill stops at its next layer (PrefillService.prefill)
                aborted.add(req)
                task.cancel()
        elif op == "load":
            queued = service.queued_tokens if isinstance(service, PrefillService) else service.load
            emit({"op": "load", "req": req, "load": queued})

    async with asyncio.TaskGroup() as tg:
        try:
            while True:
                raw: dict | None = None
                try:
                    raw = await session.recv(deadline_s)
                    if raw is None:
                        break
                    handle(*validate(raw, WORKER_OPS), tg)
                except (Garbled, BadMessage) as e:
                    send({"op": "error", "req": _req_of(raw), "error": str(e)})
                except ControlError:
                    raise
                except Exception as e:  # a bug in handling one message: say so, keep serving
                    log.exception("control message %s failed", _req_of(raw))
                    send({"op": "error", "req": _req_of(raw), "error": f"{type(e).__name__}: {e}"})
                await session.drain(deadline_s)
        finally:
            for task in jobs.values():
                task.cancel()
            if isinstance(service, DecodeService):
                for req in decoding:
                    service.abort(req)


def _req_of(raw: object) -> str:
    req = raw.get("req") if isinstance(raw, dict) else None
    return req if isinstance(req, str) and len(req) <= 256 else ""


def _link_report(service: PrefillService | DecodeService) -> dict:
    """TCP_INFO of every KV connection this worker sends on, for the gateway's link health."""
    if not isinstance(service, PrefillService):
        return {}
    tcp, queued = {}, 0
    for (host, port), sender in service.senders.items():
        queued += sender.queued_bytes
        for key, info in sender.tcp_infos().items():
            tcp[f"{host}:{port}/{key}"] = dataclasses.asdict(info)
    return {"tcp": tcp, "queued_bytes": queued}
