"""Every worker the gateway uses: started by its launcher, attached over the control channel, supervised.

    async with Workers(specs, launcher, secret, ...) as pool:   # every worker attached, or an error
        pool.workers["pd-d0"], pool.of("pd", "prefill")
        await pool.launch(spec); await pool.retire(worker)          # role changes (gateway.roles)

``make_launcher`` picks where they come from and ``attach`` proves the cluster secret both ways. Each worker has
a supervisor task: when its session is lost it gets the worker back from the launcher and attaches again, with
backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl as ssl_module
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from minifaas.cache.prefix_index import PrefixDirectory
from minifaas.config import ServeConfig
from minifaas.control.heartbeat import HeartbeatConfig
from minifaas.control.secret import load_secret, new_secret
from minifaas.control.session import ControlError, Refused, Session, SessionLost, connect
from minifaas.control.worker_ops import (
    REPLIES,
    Attach,
    Attached,
    BadMessage,
    ReplyMessage,
    Taken,
    from_wire,
)  # fmt: skip
from minifaas.gateway.inter_cluster_link import InterClusterLink
from minifaas.gateway.worker_handle import WorkerHandle
from minifaas.launch.launcher import AttachedLauncher, Launcher, WorkerError, WorkerSpec
from minifaas.launch.local import LocalLauncher
from minifaas.launch.startup import StartupListener, reported
from minifaas.launch.worker_specs import planned_specs
from minifaas.net.address import Address

if TYPE_CHECKING:
    from minifaas.launch.ray_actors import RayLauncher

OUTSIDE_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}  # sent to a process, not raised
EXIT_WAIT_S = 2.0  # how long a lost worker's exit status is waited for
log = logging.getLogger("minifaas.gateway")
RETRY_S, MAX_RETRY_S = 0.5, 5.0
ATTACH_TIMEOUT_S = 10.0  # one attempt: connect, handshake, the worker's answer
WAIT_POLL_S = 0.25  # a request waiting for a worker (or the link) to come back looks again this often
GATEWAY_ID = f"{socket.gethostname()}:{os.getpid()}"

STAGES = (("prfaas", "prefill"), ("pd", "prefill"), ("pd", "decode"))  # (cluster, role) of each kind of worker


class Busy(ControlError):
    """The worker serves another gateway."""


async def attach(
    address: Address, secret: bytes, timeout: float, ssl: ssl_module.SSLContext | None = None
) -> tuple[Session, Attached]:
    """A session with the worker at ``address`` and what it said it is; raises ControlError."""
    session = await connect(*address, secret, timeout, ssl)
    where = f"{address[0]}:{address[1]}"
    try:
        session.send(Attach(gateway=GATEWAY_ID))
        await session.drain(timeout)
        hello = await session.recv(timeout)
        if hello is None:
            raise Refused(f"{where} did not take this gateway: it hung up")
        try:
            reply = from_wire(hello, REPLIES)
        except BadMessage as e:
            raise Refused(f"{where} said what it is unreadably: {e}") from None
        if not isinstance(reply, Attached):
            kind = Busy if isinstance(reply, Taken) else Refused
            raise kind(f"{where} did not take this gateway: {getattr(reply, 'error', hello)}")
    except BaseException:
        session.close()
        raise
    return session, reply


def cluster_secret(config: ServeConfig) -> bytes:
    """The deployment's secret: given (file or environment) whenever a worker is not the gateway's own child."""
    if config.secret_file is not None or (not config.all_local and config.launcher != "ray"):
        return load_secret(config.secret_file)
    with contextlib.suppress(ValueError):  # Ray actors are the gateway's own: a fresh secret does, if none is set
        return load_secret()
    return new_secret()


def make_launcher(config: ServeConfig, secret: bytes) -> LocalLauncher | RayLauncher:
    """The launcher of the workers the gateway starts (hand-started ones are only dialled)."""
    if config.launcher != "ray":
        return LocalLauncher(secret, model=config.model if config.fork_workers else None)
    try:
        from minifaas.launch.ray_actors import RayLauncher
    except ImportError as e:
        raise ValueError(f"the Ray launcher needs the ray extra (pip install 'minifaas[ray]'): {e}") from None
    return RayLauncher(config.ray, secret, planned_specs(config))


class Workers:
    def __init__(
        self,
        specs: list[WorkerSpec],
        launcher: Launcher,
        secret: bytes,
        model: str,
        heartbeat: HeartbeatConfig,
        link: InterClusterLink,
        prefixes: PrefixDirectory,
        start_timeout: float = 300.0,
        ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        self.planned, self.launcher, self.secret, self.model = list(specs), launcher, secret, model
        self.heartbeat, self.link, self.prefixes = heartbeat, link, prefixes
        self.start_timeout, self.ssl = start_timeout, ssl
        self.attached = AttachedLauncher()
        self.workers: dict[str, WorkerHandle] = {}
        self.known_names: set[str] = set()  # a name is never reused, even after its worker is retired
        self.closing = False
        self.on_unclaimed: Callable[[WorkerHandle, ReplyMessage], None] | None = None  # given to every worker
        self.on_attached: Callable[[WorkerHandle], None] = lambda w: None  # after each attach, first or again
        self.on_startup: StartupListener | None = None  # told of each worker starting and ready; None: the log
        self._tasks: asyncio.TaskGroup | None = None
        self._joined = asyncio.Event()  # set (and replaced) whenever a worker attaches, first or again
        self._stack = contextlib.AsyncExitStack()

    def launcher_of(self, spec: WorkerSpec) -> Launcher:
        return self.attached if spec.address is not None else self.launcher

    def of(self, cluster: str, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.cluster == cluster and w.role == role]

    async def ended_by_itself(self, name: str, pid: int, wait: float = EXIT_WAIT_S) -> bool:
        """Whether worker ``name``'s process ``pid`` ended by itself rather than by a signal from outside.
        True when that cannot be known within ``wait`` seconds, so the other evidence decides."""
        w = self.workers.get(name)
        if w is None or not (launcher := self.launcher_of(w.spec)).sees_exits:
            return True
        until = time.monotonic() + wait
        while (code := launcher.exit_of(w.spec, pid)) is None and time.monotonic() < until:
            await asyncio.sleep(0.02)  # the launcher hears of the end moments after the session does
        return code is None or -code not in OUTSIDE_SIGNALS

    async def serving(self, cluster: str, role: str) -> None:
        """Return once a worker of ``cluster`` and ``role`` takes requests (the caller bounds the wait)."""
        while not any(w.serving for w in self.of(cluster, role)):
            await self._joined.wait()

    async def changed(self, within: float) -> None:
        """Return once a worker attaches, first or again, or after ``within`` seconds, whichever is first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._joined.wait(), within)

    def _join(self, w: WorkerHandle) -> None:
        self.on_attached(w)
        joined, self._joined = self._joined, asyncio.Event()
        joined.set()

    async def __aenter__(self) -> Workers:
        self._tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._stack.push_async_callback(self._shutdown)
        try:
            async with asyncio.TaskGroup() as starting:  # one failing cancels the others
                for spec in self.planned:
                    starting.create_task(self.launch(spec))
            roles = {(w.cluster, w.role) for w in self.workers.values()}  # hand-started ones say theirs on attach
            if ("pd", "decode") not in roles or not roles & {("prfaas", "prefill"), ("pd", "prefill")}:
                what = "decode worker in the PD cluster" if ("pd", "decode") not in roles else "prefill worker"
                raise WorkerError(f"no {what} among the workers attached ({', '.join(sorted(self.workers))}): every "
                                  "request would wait for one")  # fmt: skip
        except BaseException as e:
            await self._stack.aclose()
            if isinstance(e, BaseExceptionGroup):  # say why the first worker failed, not "a TaskGroup failed"
                raise e.exceptions[0] from None
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def launch(self, spec: WorkerSpec) -> WorkerHandle:
        """Start (or find) the worker, attach, and supervise it from now on."""
        launcher = self.launcher_of(spec)
        session, address = None, None
        try:
            what = f"{spec.cluster} {spec.role} worker" if spec.role else f"hand-started {spec.cluster} worker"
            first = self._first_attach(spec, launcher)
            session, hello, address = await reported(self.on_startup, spec.name or spec.label, what, first)
            if hello.name in self.workers:
                raise WorkerError(f"two workers call themselves {hello.name}: give one another --name")
            w = WorkerHandle(spec, hello.name, hello.role, hello.cluster, self.prefixes)
            w.on_unclaimed = self.on_unclaimed
            w.attached(session, hello, address)
            await self.link.join(w)
        except BaseException:
            if session is not None:
                session.close()
            await launcher.stop(spec)
            raise
        self.prefixes.forget(w.name)  # its inventory follows on the session
        self.known_names.add(w.name)
        self.workers[w.name] = w
        self._join(w)
        assert self._tasks is not None
        self._tasks.create_task(self._supervise(w))
        log.debug("worker %s (%s, %s) attached at %s:%d, pid %d", w.name, w.role, w.cluster, *address, w.pid)
        return w

    async def _first_attach(self, spec: WorkerSpec, launcher: Launcher) -> tuple:
        address = await launcher.start(spec)
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                session, hello = await attach(address, self.secret, ATTACH_TIMEOUT_S, self.ssl)
                break
            except (SessionLost, Busy) as e:  # not listening yet (still loading), or another gateway has it
                if time.monotonic() > deadline:
                    raise WorkerError(f"{spec.label} did not answer within {self.start_timeout:.0f} s: {e}") from None
                log.info("waiting for %s: %s", spec.label, e)
                await asyncio.sleep(2.0)
            except Refused as e:
                raise WorkerError(f"{spec.label} refused this gateway: {e}") from None
        try:
            self._check(spec, hello)
        except WorkerError:
            session.close()
            raise
        return session, hello, address

    def _check(self, spec: WorkerSpec, hello: Attached) -> None:
        said = (hello.name, hello.role, hello.cluster)
        if not all(said):
            raise WorkerError(f"{spec.label} did not say what it is: {hello}")
        if hello.model != self.model:
            raise WorkerError(f"{spec.label} serves the model {hello.model}; this gateway serves {self.model}")
        wanted = (spec.name or said[0], spec.role or said[1], spec.cluster)
        if said != wanted or said[1] not in ("prefill", "decode") or (said[2], said[1]) == ("prfaas", "decode"):
            raise WorkerError(f"{spec.label} says it is the {said[2]} {said[1]} worker {said[0]}, where the "
                              f"{wanted[2]} {wanted[1]} worker {wanted[0]} was expected")  # fmt: skip

    async def retire(self, w: WorkerHandle) -> None:
        """Stop a worker for good (it changes role: ``gateway.roles``); forget its pool and its link."""
        w.retired = True
        self.workers.pop(w.name, None)
        w.detach()
        await self.launcher_of(w.spec).stop(w.spec)
        await self.link.leave(w)
        self.prefixes.drop(w.name)

    async def _supervise(self, w: WorkerHandle) -> None:
        """Run the worker's session; when it is lost, get the worker back and attach again."""
        while True:
            lost = await w.pump(self.heartbeat)
            if self.closing or w.retired:
                return
            log.error("worker %s left routing: %s", w.name, lost)
            delay = RETRY_S
            while not (self.closing or w.retired):
                try:
                    address = await self.launcher_of(w.spec).start(w.spec)
                    session, hello = await attach(address, self.secret, ATTACH_TIMEOUT_S, self.ssl)
                    try:
                        self._check(w.spec, hello)
                        if (hello.name, hello.role) != (w.name, w.role):
                            raise WorkerError(f"{hello.name} ({hello.role}) answers where {w.name} was")
                    except WorkerError:
                        session.close()  # a worker that is not this one is left free for its own gateway
                        raise
                    w.attached(session, hello, address)
                    await self.link.join(w)
                    break
                except (ControlError, WorkerError, OSError) as e:
                    log.warning("worker %s not back yet (%s); again in %.1f s", w.name, e, delay)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, MAX_RETRY_S)
            if self.closing or w.retired:  # shutdown began meanwhile, after it stopped the workers it knew of
                w.detach()
                return
            w.rejoins += 1
            self._join(w)
            log.info("worker %s rejoined (pid %d)", w.name, w.pid)

    async def _shutdown(self) -> None:
        self.closing = True
        for w in self.workers.values():
            w.detach()
        await asyncio.gather(*(self.launcher_of(w.spec).stop(w.spec) for w in self.workers.values()))
