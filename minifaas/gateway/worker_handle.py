"""The gateway's handle on one worker: talk to it over its control session, notice when it is gone.

``pump`` runs the session, pings the worker and sorts each reply into its request's inbox; its cache events keep
the gateway's mirror of its prefix cache current. When the session is lost every open inbox receives ``Lost``,
so no request waits on a worker that is gone. A ``draining`` worker is routed nothing new.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from minifaas.cache.prefix_index import PrefixDirectory
from minifaas.control.heartbeat import HeartbeatConfig, keep_alive
from minifaas.control.session import ControlError, PeerSilent, Session, SessionLost
from minifaas.control.worker_ops import (
    REPLIES,
    Attached,
    BadMessage,
    CacheEvents,
    OpMessage,
    Ping,
    Pong,
    ReplyMessage,
    Tokens,
    from_wire,
)  # fmt: skip
from minifaas.launch.launcher import WorkerError, WorkerSpec
from minifaas.net.address import Address
from minifaas.net.connections import TcpInfo

log = logging.getLogger("minifaas.gateway")


@dataclass(frozen=True, slots=True)
class Lost:
    """The gateway's own word, put in every open inbox when the worker's session is lost: whether the worker
    went silent, and which requests it had taken without a step of them."""

    silent: bool = False
    unstepped: tuple[str, ...] = ()
    pid: int = 0


Inbound = ReplyMessage | Lost  # what a request's inbox holds


class WorkerHandle:
    def __init__(self, spec: WorkerSpec, name: str, role: str, cluster: str, prefixes: PrefixDirectory) -> None:
        self.spec, self.name, self.role, self.cluster = spec, name, role, cluster
        self.prefixes = prefixes  # the gateway's mirror of every worker's prefix cache
        self.session: Session | None = None
        self.address: Address | None = None  # its control port
        self.kv: Address | None = None  # where KV for it goes (its advertised address)
        self.pid = 0
        self.alive = False
        self.rejoins = 0  # times it came back after its session was lost
        self.load_tokens = 0  # prompt tokens sent and not yet answered (prefill) / requests decoding
        self.inboxes: dict[str, asyncio.Queue[Inbound]] = {}  # request -> its replies
        self.draining = False  # changing role: routed nothing new
        self.retired = False  # stopped for good (replaced by a worker in its new role)
        self.claims = 0  # prefills routed here that have not opened their inbox yet
        self.tcp: dict[str, TcpInfo] = {}  # its KV connections, as of its last pong
        self.queued_bytes = 0  # KV it has not handed to a socket yet, as of its last pong
        self.codecs: dict[str, list[float]] = {}  # what a prefill worker measured of its codecs when it started
        self.kernels = "unknown"  # what its linear-attention layers run (fla, torch, none), as it says
        self.max_batch = 0  # a decode worker's rows per forward (0: not said)
        self.unstepped: set[str] = set()  # requests sent to its batch that no step has answered yet
        self._quieter = asyncio.Event()  # set whenever a request lets go of the worker
        self.gone = asyncio.Event()  # this session's end: a new one per attach, so a waiter sees its own session go
        self.on_unclaimed: Callable[[WorkerHandle, ReplyMessage], None] | None = None

    @property
    def serving(self) -> bool:
        """Takes new requests: attached and not draining."""
        return self.alive and not self.draining

    @property
    def requests(self) -> int:
        """Requests waiting on replies from the worker."""
        return len(self.inboxes)

    @property
    def busy(self) -> int:
        """Requests that still hold the worker."""
        return self.claims + self.requests

    def release(self) -> None:
        """A claim is over (the prefill opened its inbox, or went elsewhere)."""
        self.claims -= 1
        self._quieter.set()

    async def wait_idle(self) -> None:
        while self.busy:
            self._quieter.clear()
            await self._quieter.wait()

    def attached(self, session: Session, hello: Attached, address: Address) -> None:
        """The session is up: take the worker's own account of where it listens."""
        self.session, self.address, self.pid = session, address, hello.pid
        self.codecs, self.kernels = hello.codecs, hello.kernels
        self.max_batch = hello.max_batch or 0  # a decode worker's rows per forward, as it sized them
        kv = hello.kv
        self.kv = (kv[0] or address[0], kv[1]) if kv else None  # no host: the one we reached it at
        self.gone = asyncio.Event()
        self.alive = True

    async def pump(self, heartbeat: HeartbeatConfig) -> SessionLost:
        """Run the session until it is lost, then wake every waiting request with ``Lost`` and forget the worker's
        cache (a re-attached worker sends its inventory again; a retired one is dropped). Returns why it ended."""
        assert self.session is not None
        lost: SessionLost | None = None
        try:
            lost = await keep_alive(self.session, heartbeat, self._deliver, Ping)
            return lost
        finally:
            self.alive = False
            self.gone.set()
            news = Lost(isinstance(lost, PeerSilent), tuple(sorted(self.unstepped)), self.pid)
            self.unstepped = set()
            for inbox in self.inboxes.values():
                inbox.put_nowait(news)
            if self.retired:
                self.prefixes.drop(self.name)
            else:
                self.prefixes.forget(self.name)

    def _deliver(self, raw: dict) -> None:
        try:
            msg = from_wire(raw, REPLIES)
        except BadMessage as e:  # a worker of another version, or a bug: what waits on it times out
            log.warning("worker %s: unreadable reply: %s", self.name, e)
            return
        if isinstance(msg, Pong):
            self.tcp = msg.tcp or {}
            self.queued_bytes = msg.queued_bytes or 0
            return
        if isinstance(msg, CacheEvents):
            self.prefixes.apply([e.event() for e in msg.events])
            return
        if isinstance(msg, Tokens):  # one decode step's tokens, each to its request's inbox
            for token in msg.tokens:
                self._route(token)
            return
        self._route(msg)

    def _route(self, msg: ReplyMessage) -> None:
        inbox = self.inboxes.get(getattr(msg, "req", ""))
        if inbox is not None:
            inbox.put_nowait(msg)
        else:
            self.unclaimed(msg)

    def unclaimed(self, msg: ReplyMessage) -> None:
        """A message no waiting request wants (a stopped prefill's news, a reply that came too late)."""
        if self.on_unclaimed is not None:
            self.on_unclaimed(self, msg)

    def open(self, req: str) -> asyncio.Queue[Inbound]:
        self.inboxes[req] = asyncio.Queue()
        return self.inboxes[req]

    def close(self, req: str) -> None:
        self.inboxes.pop(req, None)
        self._quieter.set()

    def send(self, message: OpMessage) -> None:
        if not self.alive or self.session is None:
            raise WorkerError(f"worker {self.name} is not attached")
        try:
            self.session.send(message)
        except ControlError as e:
            raise WorkerError(f"worker {self.name}: {e}") from None

    def detach(self) -> None:
        """End the session; the worker stays as it is (a local one is stopped by its launcher)."""
        self.alive = False
        if self.session is not None:
            self.session.close()

    def kill(self) -> None:
        """Kill the worker's process now (fault injection in tests and the demo; same host only)."""
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
