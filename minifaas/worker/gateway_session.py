"""One gateway's session with a worker: control messages in, the worker's replies out.

A worker serves one gateway at a time (``control.server`` refuses a second).
On ``attach`` it says what it is and sends its pool's inventory, so a gateway
that restarted learns what the node already holds.

Every message is checked against ``WORKER_OPS`` first, then goes to its op's
handler; one the table refuses, or whose handling raises, is answered ``error``
and the session goes on. Each request runs as a task of the session. When the
session ends (the gateway closed it, went silent past the deadline, or sent a
frame that failed its MAC), every request it started is aborted: a prefill
stops, a decode row is freed, and nothing waits for a gateway that is gone.
A decode step's tokens leave as one ``tokens`` frame at the loop's next turn;
any other message sends them first, so each request's messages keep their order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from minifaas.cache.pool import HybridPrefixPool
from minifaas.control.schema import BadMessage, validate
from minifaas.control.session import ControlError, Garbled, Session
from minifaas.control.worker_ops import CACHE_EVENTS, WORKER_OPS, Op, Reply
from minifaas.model.batch_decoder import BatchDecoder
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
        if isinstance(self.service, DecodeService):  # its rows per forward, as it sized them
            decoder = self.service.decoder
            fields["max_batch"] = decoder.config.max_batch if isinstance(decoder, BatchDecoder) else 1
        return {**fields, "kv": self.kv, "pid": self.pid, "codecs": self.codecs, "kernels": self.kernels}


async def serve_gateway(node: WorkerNode, session: Session, deadline_s: float) -> None:
    """Serve one gateway's session until it ends; then abort every request it started."""
    await GatewaySession(node, session, deadline_s).serve()


class GatewaySession:
    """A session's requests, and one handler per op."""

    def __init__(self, node: WorkerNode, session: Session, deadline_s: float) -> None:
        self.node, self.session, self.deadline_s = node, session, deadline_s
        self.service, self.prefixes = node.service, node.prefixes
        self.jobs: dict[str, asyncio.Task[None]] = {}
        self.aborted: set[str] = set()  # requests the gateway aborted whose job has not ended yet
        self.decoding: set[str] = set()  # this session's decode requests, until their last message or abort
        self.tasks: asyncio.TaskGroup | None = None
        self.tokens: list[dict] = []  # token messages of this turn of the loop, not sent yet (``emit``)
        self.handlers: dict[str, Callable[[dict], None]] = {
            Op.ATTACH: self.attach,
            Op.PING: self.ping,
            Op.PREFILL: self.run,
            Op.EXPORT: self.run,
            Op.DECODE: self.run,
            Op.START: self.start,
            Op.ABORT: self.abort,
            Op.LOAD: self.load,
        }
        if isinstance(self.service, PrefillService):  # a prompt's blocks are stored after its reply: news follows
            self.service.kept = self.send_cache_events

    def send(self, message: dict) -> None:
        self.send_tokens()
        if not self.session.closed:  # after the session ended its requests answer no one
            self.session.send(message)

    def send_tokens(self) -> None:
        """The token messages held back so far, as one ``tokens`` message."""
        if self.tokens:
            tokens, self.tokens = self.tokens, []
            if not self.session.closed:
                self.session.send({"op": Reply.TOKENS, "tokens": tokens})

    def send_cache_events(self) -> None:
        if self.node.pool is not None and (events := self.node.pool.drain_events()):
            self.send({"op": Reply.CACHE, "req": CACHE_EVENTS, "events": [e.to_json() for e in events]})

    def emit(self, message: dict) -> None:
        self.send_cache_events()  # the pool's changes go out before the news that follows them
        if message["op"] == Reply.TOKEN:  # held until this turn of the loop is over: a step's tokens in one frame
            if not self.tokens:
                asyncio.get_running_loop().call_soon(self.send_tokens)
            self.tokens.append({k: v for k, v in message.items() if k != "op"})
            return
        self.send(message)
        if message["op"] in (Reply.DONE, Reply.FAILED) or message.get("finish"):
            self.decoding.discard(message["req"])  # its row is gone: nothing to abort when the session ends

    async def serve(self) -> None:
        async with asyncio.TaskGroup() as self.tasks:
            try:
                while await self.next_message():
                    await self.session.drain(self.deadline_s)
            finally:
                self.end()

    async def next_message(self) -> bool:
        """Take one message and handle it; False once the gateway has closed the session."""
        raw: dict | None = None
        try:
            raw = await self.session.recv(self.deadline_s)
            if raw is None:
                return False
            op, msg = validate(raw, WORKER_OPS)
            self.handlers[op](msg)
        except (Garbled, BadMessage) as e:
            self.send({"op": Reply.ERROR, "req": _req_of(raw), "error": str(e)})
        except ControlError:
            raise
        except Exception as e:  # a bug in handling one message: say so, keep serving
            log.exception("control message %s failed", _req_of(raw))
            self.send({"op": Reply.ERROR, "req": _req_of(raw), "error": f"{type(e).__name__}: {e}"})
        return True

    def end(self) -> None:
        for task in self.jobs.values():
            task.cancel()
        if isinstance(self.service, DecodeService):
            for req in self.decoding:
                self.service.abort(req)

    def attach(self, msg: dict) -> None:
        self.send({"op": Reply.ATTACHED, **self.node.describe(), "deadline_s": self.deadline_s})
        pool = self.node.pool
        events = pool.inventory(time.perf_counter()) if pool is not None else []
        for i in range(0, len(events), INVENTORY_BATCH):
            batch = [e.to_json() for e in events[i : i + INVENTORY_BATCH]]
            self.send({"op": Reply.CACHE, "req": CACHE_EVENTS, "events": batch})

    def ping(self, msg: dict) -> None:
        self.send({"op": Reply.PONG, **_link_report(self.service)})

    def run(self, msg: dict) -> None:
        """Start a prefill, export or decode as a task of the session."""
        op, req = msg["op"], msg["req"]
        if (op == Op.DECODE) != isinstance(self.service, DecodeService):
            raise BadMessage(f"a {self.node.role} worker does not {op}")
        if req in self.jobs:
            raise BadMessage(f"request {req!r} is already running")
        if op == Op.DECODE and self.prefixes is not None:
            pinned = self.prefixes.pin(msg["transfer"], msg["tokens"], msg["link_start"], time.perf_counter())
            if msg["link_start"]:
                self.emit({"op": Reply.PINNED, "req": req, "transfer": msg["transfer"], "tokens": pinned})
        if op == Op.DECODE:
            self.decoding.add(req)
        assert self.tasks is not None
        self.jobs[req] = self.tasks.create_task(self.job(msg))

    def start(self, msg: dict) -> None:
        if isinstance(self.service, DecodeService):  # a prefill worker has no use for it
            self.service.start(msg["req"], msg["next_token"])

    def abort(self, msg: dict) -> None:
        req = msg["req"]
        if isinstance(self.service, DecodeService):
            self.service.abort(req)
            self.decoding.discard(req)
        task = self.jobs.pop(req, None)
        if task is not None:  # a prefill stops at its next layer (PrefillService.prefill)
            self.aborted.add(req)
            task.cancel()

    def load(self, msg: dict) -> None:
        service = self.service
        queued = service.queued_tokens if isinstance(service, PrefillService) else service.load
        self.emit({"op": Reply.LOAD, "req": msg["req"], "load": queued})

    async def job(self, msg: dict) -> None:
        """One request's work, and its answer however it ends."""
        req = msg["req"]
        try:
            await self.work(msg)
        except asyncio.CancelledError:  # aborted by the gateway, or the session is over
            stopped = isinstance(self.service, PrefillService) and msg["op"] == Op.PREFILL
            done = self.service.stopped_at.pop(req, 0) if stopped else 0  # type: ignore[union-attr]
            if stopped and req in self.aborted:
                self.emit({"op": Reply.ABORTED, "req": req, "tokens": len(msg["tokens"]), "done_tokens": done})
        except (TransferError, TimeoutError, OSError, ValueError, RuntimeError) as e:
            self.emit(_failed(msg, e))
        except Exception as e:  # a bug: report it with its trace rather than leave the request hanging
            self.emit(_failed(msg, e))
            traceback.print_exc()
        finally:
            if self.prefixes is not None:
                self.prefixes.cancel(msg["transfer"])  # unpins a prefix whose state never arrived
            if self.jobs.get(req, asyncio.current_task()) is asyncio.current_task():  # not a retry's, same id
                self.jobs.pop(req, None)
                self.aborted.discard(req)

    async def work(self, msg: dict) -> None:
        service = self.service
        if isinstance(service, DecodeService):
            await service.decode(msg, self.emit)
        elif msg["op"] == Op.EXPORT:
            self.emit(await service.export(msg))
        else:  # ``first`` is sent as it is; the pool's news goes out with the reply
            self.emit(await service.prefill(msg, self.send))


def _failed(msg: dict, e: BaseException) -> dict:
    return {"op": Reply.FAILED, "req": msg["req"], "transfer": msg["transfer"], "error": f"{type(e).__name__}: {e}"}


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
