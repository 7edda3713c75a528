"""One gateway's session with a worker: control messages in, the worker's replies out; one class per role.

Every message is read as its op's dataclass (``from_wire``) and goes to its op's handler; one that is refused,
or whose handling raises, is answered ``error`` and the session goes on. Each request runs as a task of the
session, and when the session ends every request it started is aborted. On ``attach`` the worker sends its
pool's inventory; a decode step's tokens leave as one ``tokens`` frame, ahead of any later message.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

from minifaas.cache.pool import HybridPrefixPool
from minifaas.control import worker_ops as ops
from minifaas.control.session import ControlError, Garbled, Session
from minifaas.net.errors import TransferError
from minifaas.worker.decode_service import DecodeService
from minifaas.worker.prefill_service import PrefillService
from minifaas.worker.prefix_moves import export

log = logging.getLogger("minifaas.worker")
INVENTORY_BATCH = 1000  # cache events per message when a gateway attaches
Job = ops.Prefill | ops.Export | ops.Decode  # a request's work, run as a task of the session
FAILURES = (TransferError, TimeoutError, OSError, ValueError, RuntimeError)  # a request's; others are bugs


class WorkerSession:
    """A session's requests, and a handler per op; ``PrefillSession`` and ``DecodeSession`` add their role's
    handlers and its ``work``, which answers a cancelled request itself."""

    def __init__(self, node: ops.Attached, session: Session, pool: HybridPrefixPool | None) -> None:
        self.node, self.session, self.deadline_s, self.pool = node, session, node.deadline_s, pool
        self.jobs: dict[str, asyncio.Task[None]] = {}
        self.aborted: set[str] = set()  # requests the gateway aborted whose job has not ended yet
        self.tasks: asyncio.TaskGroup | None = None
        self.tokens: list[ops.Token] = []  # token messages of this turn of the loop, not sent yet (``emit``)
        self.handlers: dict[type[ops.OpMessage], Callable[[Any], None]] = {
            ops.Attach: self.attach,
            ops.Ping: self.ping,
            ops.Abort: self.abort,
        }

    def send(self, message: ops.ReplyMessage) -> None:
        self.send_tokens()
        if not self.session.closed:  # after the session ended its requests answer no one
            self.session.send(message)

    def send_tokens(self) -> None:
        """The token messages held back so far, as one ``tokens`` message."""
        tokens, self.tokens = self.tokens, []
        if tokens and not self.session.closed:
            self.session.send(ops.Tokens(tokens=tokens))

    def send_cache_events(self) -> None:
        if self.pool is not None and (events := self.pool.drain_events()):
            self.send(ops.CacheEvents(req=ops.CACHE_EVENTS, events=[ops.WireEvent.of(e) for e in events]))

    def emit(self, message: ops.ReplyMessage) -> None:
        self.send_cache_events()  # the pool's changes go out before the news that follows them
        if isinstance(message, ops.Token):  # held until this turn of the loop is over: a step's tokens in one frame
            if not self.tokens:
                asyncio.get_running_loop().call_soon(self.send_tokens)
            self.tokens.append(message)
            return
        self.send(message)

    async def serve(self) -> None:
        """Serve the session until it ends; then abort every request it started."""
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
            msg = ops.from_wire(raw, ops.OPS)
            if type(msg) not in self.handlers:
                raise ops.BadMessage(f"a {self.node.role} worker does not {msg.op}")
            self.handlers[type(msg)](msg)
        except (Garbled, ops.BadMessage) as e:
            self.send(ops.Error(req=_req_of(raw), error=str(e)))
        except ControlError:
            raise
        except Exception as e:  # a bug in handling one message: say so, keep serving
            log.exception("control message %s failed", _req_of(raw))
            self.send(ops.Error(req=_req_of(raw), error=f"{type(e).__name__}: {e}"))
        return True

    def end(self) -> None:
        for task in self.jobs.values():
            task.cancel()

    def attach(self, msg: ops.Attach) -> None:
        self.send(self.node)  # what this worker is
        events = self.pool.inventory(time.perf_counter()) if self.pool is not None else []
        for i in range(0, len(events), INVENTORY_BATCH):
            batch = [ops.WireEvent.of(e) for e in events[i : i + INVENTORY_BATCH]]
            self.send(ops.CacheEvents(req=ops.CACHE_EVENTS, events=batch))

    def ping(self, msg: ops.Ping) -> None:
        self.send(ops.Pong())

    def run(self, msg: Job) -> None:
        """Start a request's work as a task of the session."""
        if msg.req in self.jobs:
            raise ops.BadMessage(f"request {msg.req!r} is already running")
        assert self.tasks is not None
        self.jobs[msg.req] = self.tasks.create_task(self.job(msg))

    def abort(self, msg: ops.Abort) -> None:
        task = self.jobs.pop(msg.req, None)
        if task is not None:  # a prefill stops at its next layer (PrefillService.prefill)
            self.aborted.add(msg.req)
            task.cancel()

    async def job(self, msg: Job) -> None:
        """One request's work, and its answer however it ends."""
        req = msg.req
        try:
            await self.work(msg)
        except asyncio.CancelledError:  # aborted by the gateway, or the session is over: ``work`` answered
            pass
        except Exception as e:
            self.emit(ops.Failed(req=req, transfer=msg.transfer, error=f"{type(e).__name__}: {e}"))
            if not isinstance(e, FAILURES):  # a bug: its trace too, rather than leave the request hanging
                traceback.print_exc()
        finally:
            if self.jobs.get(req, asyncio.current_task()) is asyncio.current_task():  # not a retry's, same id
                self.jobs.pop(req, None)
                self.aborted.discard(req)

    async def work(self, msg: Job) -> None:
        raise NotImplementedError


class PrefillSession(WorkerSession):
    """A prefill worker's session: ``prefill`` and ``export``; the pool's news follows each prompt's store."""

    def __init__(self, node: ops.Attached, session: Session, service: PrefillService) -> None:
        super().__init__(node, session, service.store.pool)
        self.service = service
        self.handlers |= {ops.Prefill: self.run, ops.Export: self.run, ops.Start: self.start, ops.Load: self.load}
        service.kept = self.send_cache_events  # a prompt's blocks are stored after its reply: news follows

    def start(self, msg: ops.Start) -> None:
        """A prefill worker has no use for a first token."""

    def load(self, msg: ops.Load) -> None:
        self.emit(ops.LoadReply(req=msg.req, load=self.service.queued_tokens))

    def ping(self, msg: ops.Ping) -> None:
        """With TCP_INFO of every KV connection this worker sends on, for the gateway's link health."""
        tcp, queued = {}, 0
        for (host, port), sender in self.service.senders.items():
            queued += sender.queued_bytes
            for key, info in sender.tcp_infos().items():
                tcp[f"{host}:{port}/{key}"] = info
        self.send(ops.Pong(tcp=tcp, queued_bytes=queued))

    async def work(self, msg: Job) -> None:
        if isinstance(msg, ops.Export):
            self.emit(await export(self.service.store, self.service.sender, msg, self.service.codec(msg)))
            return
        try:  # ``first`` is sent as it is; the pool's news goes out with the reply
            self.emit(await self.service.prefill(msg, self.send))
        except asyncio.CancelledError:
            done = self.service.stopped_at.pop(msg.req, 0)
            if msg.req in self.aborted:
                self.emit(ops.Aborted(req=msg.req, tokens=len(msg.tokens), done_tokens=done))
            raise


class DecodeSession(WorkerSession):
    """A decode worker's session: ``decode`` and ``start``; a request's row is freed when the session ends."""

    def __init__(self, node: ops.Attached, session: Session, service: DecodeService) -> None:
        self.service, self.prefixes = service, service.prefixes
        super().__init__(node, session, self.prefixes.pool if self.prefixes is not None else None)
        self.decoding: set[str] = set()  # this session's decode requests, until their last message or abort
        self.handlers |= {ops.Decode: self.run, ops.Start: self.start, ops.Load: self.load}

    def load(self, msg: ops.Load) -> None:
        self.emit(ops.LoadReply(req=msg.req, load=self.service.load))

    def emit(self, message: ops.ReplyMessage) -> None:
        super().emit(message)
        if isinstance(message, (ops.Done, ops.Failed)) or (isinstance(message, ops.Token) and message.finish):
            self.decoding.discard(message.req)  # its row is gone: nothing to abort when the session ends

    def run(self, msg: Job) -> None:
        super().run(msg)  # its task starts on the loop's next turn, after these
        if self.prefixes is not None:
            pinned = self.prefixes.pin(msg.transfer, msg.tokens, msg.link_start)
            if msg.link_start:
                self.emit(ops.Pinned(req=msg.req, transfer=msg.transfer, tokens=pinned))
        self.decoding.add(msg.req)

    def start(self, msg: ops.Start) -> None:
        self.service.start(msg.req, msg.next_token)

    def abort(self, msg: ops.Abort) -> None:
        self.service.abort(msg.req)
        self.decoding.discard(msg.req)
        super().abort(msg)

    def end(self) -> None:
        super().end()
        for req in self.decoding:
            self.service.abort(req)

    async def work(self, msg: Job) -> None:
        try:
            await self.service.decode(msg, self.emit)
        finally:
            if self.prefixes is not None:
                self.prefixes.cancel(msg.transfer)  # unpins a prefix whose state never arrived


def _req_of(raw: object) -> str:
    req = raw.get("req") if isinstance(raw, dict) else None
    return req if isinstance(req, str) and len(req) <= 256 else ""
