"""The PrfaaS -> PD link as the gateway uses it: emulated beside the gateway, or the real network.

Emulated: a supervised link emulator process relays the PrfaaS cluster's state to each decode worker, so the
egress shares one ceiling; its counters are the link's reading. Real: KV goes straight to each decode worker,
and a ``LinkMonitor`` reads egress, rtt and retransmissions from the PrfaaS workers' TCP_INFO reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter
from dataclasses import dataclass

from minifaas.config import InterClusterLinkConfig
from minifaas.control.heartbeat import HeartbeatConfig
from minifaas.emulator.emulator_process import EmulatorControl, EmulatorError, EmulatorProcess
from minifaas.emulator.pacer import parse_rate
from minifaas.gateway.worker_handle import WorkerHandle
from minifaas.launch.startup import StartupListener, reported
from minifaas.net.address import Address
from minifaas.net.connections import TcpInfo
from minifaas.net.link_health import LinkMonitor

NAME = "prfaas->pd"  # the inter-cluster link's name in /metrics
log = logging.getLogger("minifaas.gateway")
EMULATOR_OPTIONS = ("rate", "flow_rate", "window", "delay_ms", "jitter_ms")  # the emulator's, from the link's config
RETRY_S, MAX_RETRY_S = 0.5, 5.0  # an emulator that does not start again: the next try after 0.5, 1, 2, 4, 5, 5... s


@dataclass(frozen=True, slots=True)
class LinkReading:
    egress_bps: float  # PrfaaS egress since the previous reading (0 when nothing new was measured)
    rate_bps: float  # the ceiling now: inf when unlimited or unknown, 0 when cut
    rtt_ms: float = 0.0  # mean smoothed rtt of the KV connections; 0: not measured
    retrans_rate: float = 0.0  # retransmitted / sent bytes since the previous reading

    @property
    def utilisation(self) -> float:
        return self.egress_bps / self.rate_bps if 0 < self.rate_bps < math.inf else 0.0


class LinkNotReady(RuntimeError):
    """The emulated link has no route to a decode worker now (a RuntimeError: dispatch falls back on it)."""


class LinkDown(RuntimeError):
    """The link went out of service while a transfer was crossing it."""


class InterClusterLink:
    def __init__(
        self, config: InterClusterLinkConfig, emulated: bool, moves: bool, heartbeat: HeartbeatConfig | None = None
    ) -> None:
        self.config, self.emulated, self.moves = config, emulated, moves
        self.heartbeat = heartbeat or HeartbeatConfig()
        self.secret: bytes | None = None  # the emulators' control ports take the cluster secret; None: a fresh one
        self.emulator: EmulatorProcess | None = None  # PrfaaS -> PD: every PrfaaS state crosses it
        self.routes: dict[str, tuple[str, int]] = {}  # decode worker -> its KV port, behind the emulator
        self.kv_routes: dict[str, Address] = {}  # decode worker -> where PrfaaS KV for it goes, once routed
        self.move_links: dict[str, EmulatorProcess] = {}  # the link into each prefill node, for cache moves
        self.down: dict[str, str] = {}  # emulator (NAME, or "<prefill node>-link") -> why it is out of service
        self.restarts: Counter[str] = Counter()
        self.stats: dict = {}  # the emulator's last counters
        self._uptime = -1.0  # of the counters last read, so a stale reading counts no egress
        rate = parse_rate(config.rate)
        self._monitor = LinkMonitor(rate or 1.0)
        self._rate = rate or math.inf
        self.on_startup: StartupListener | None = None  # told of each emulator starting and ready; None: the log
        self._stack = contextlib.AsyncExitStack()
        self._tasks: asyncio.TaskGroup | None = None
        self._watchers: dict[str, asyncio.Task] = {}  # emulator name -> its supervisor
        self._joining = asyncio.Lock()  # workers join at once as they start: one emulator, however many join
        self._closing = False
        self.cut = asyncio.Event()  # set when the link leaves service; a fresh one each time it is back
        self.up = True  # PrfaaS KV can cross now: always over the network; through the emulator unless it is down

    async def __aenter__(self) -> InterClusterLink:
        self._tasks = await self._stack.enter_async_context(asyncio.TaskGroup())  # out last: after the emulators
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing = True
        for task in self._watchers.values():  # no restart once the emulators are being stopped
            task.cancel()
        await self._stack.aclose()

    @property
    def generation(self) -> int:
        """Times the link came back into service: a transfer that failed on it may be tried again after one."""
        return self.restarts[NAME]

    def emulators(self) -> dict[str, EmulatorProcess]:
        """Every emulator process by its name in /health and /metrics."""
        named = {NAME: self.emulator} if self.emulator is not None else {}
        return named | {f"{name}-link": e for name, e in self.move_links.items()}

    async def _started(self, name: str, what: str, target: tuple[str, int]) -> EmulatorProcess:
        options = {k: getattr(self.config, k) for k in EMULATOR_OPTIONS}
        entered = self._stack.enter_async_context(EmulatorProcess(target, secret=self.secret, **options))
        emulator = await reported(self.on_startup, name, what, entered)
        assert self._tasks is not None, "enter the link first"
        assert name not in self._watchers, f"a second {name} emulator"
        self._watchers[name] = self._tasks.create_task(self._supervise(name, emulator))
        return emulator

    async def _supervise(self, name: str, emulator: EmulatorProcess) -> None:
        """Ping the emulator each interval; when it is gone or late, take it out of service and restart it."""
        hb = self.heartbeat
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(emulator.exited(), hb.interval_s)
            if self._closing:
                return
            if not emulator.alive:
                why = "its process exited"
            else:
                try:
                    await emulator.control.ping(hb.deadline_s)
                    continue
                except Exception as e:  # any failed probe: a supervisor that raised would cancel the gateway
                    why = f"no answer to a ping within {hb.deadline_s:g} s ({e!r})" if emulator.alive else repr(e)
            self.down[name] = why
            if name == NAME:
                self.up = False
                self.cut.set()  # transfers crossing it now fail at once rather than at their timeout
            log.error("link emulator %s (pid %d) left service: %s", name, emulator.pid, why)
            delay = RETRY_S
            while not self._closing:
                try:
                    await emulator.restart()
                    break
                except Exception as e:  # as above: keep trying, never take the gateway down with it
                    log.warning("link emulator %s not back yet (%r); again in %.1f s", name, e, delay)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, MAX_RETRY_S)
            if self._closing:
                return
            del self.down[name]
            if name == NAME:
                self._publish()  # the routes came back on new ports
                self.cut, self.up = asyncio.Event(), True
            self.restarts[name] += 1
            log.info("link emulator %s back (pid %d), %d routes", name, emulator.pid, len(emulator.routes) + 1)

    @property
    def control(self) -> EmulatorControl:
        """The emulator's control port (rate changes, stalls, cuts); emulated links only."""
        if self.emulator is None:
            raise RuntimeError("the link is not emulated (or no decode worker is up yet)")
        return self.emulator.control

    async def join(self, w: WorkerHandle) -> None:
        """Put the emulated link in front of what crosses clusters into ``w`` (once; it keeps its KV port)."""
        if not self.emulated or w.kv is None:
            return
        async with self._joining:
            if w.role == "decode" and w.name not in self.routes:
                if self.emulator is None:  # the link starts with the first decode worker
                    self.emulator = await self._started(NAME, f"link emulator, {self.config.rate}", w.kv)
                else:
                    self.emulator.routes[w.kv] = 0  # a restart of the emulator routes it, whatever happens now
                    try:
                        await self.emulator.add_route(w.kv)
                    except EmulatorError as e:  # the emulator is down: its restart brings the route
                        log.warning("no route to %s through the link yet: %s", w.name, e)
                self.routes[w.name] = w.kv
                self._publish()
            elif w.role == "prefill" and self.moves and w.name not in self.move_links:
                self.move_links[w.name] = await self._started(f"{w.name}-link", "link emulator for cache moves", w.kv)

    async def leave(self, w: WorkerHandle) -> None:
        async with self._joining:
            target = self.routes.pop(w.name, None)
            if target is not None and self.emulator is not None:
                self._publish()
                with contextlib.suppress(EmulatorError, OSError, TimeoutError):
                    if target == self.emulator.target:
                        await self.emulator.control.remove_route(self.emulator.port)
                    else:
                        await self.emulator.remove_route(target)
            emulator = self.move_links.pop(w.name, None)
            if emulator is not None:
                watcher = self._watchers.pop(f"{w.name}-link", None)
                if watcher is not None:
                    watcher.cancel()
                self.down.pop(f"{w.name}-link", None)
                await emulator.__aexit__(None, None, None)

    def _publish(self) -> None:
        """Where PrfaaS KV for each decode worker goes now (``kv_routes``): the emulator's port for it, once it
        answered; a prefill to a decode worker with none falls back."""
        e = self.emulator
        assert e is not None
        ports = {name: e.port if target == e.target else e.routes.get(target) for name, target in self.routes.items()}
        self.kv_routes = {name: ("127.0.0.1", port) for name, port in ports.items() if port}

    def move_address(self, dst: WorkerHandle) -> Address | None:
        """Where a cache move into ``dst`` goes, or None if ``dst`` takes none."""
        if dst.kv is None:
            return None
        if self.emulated:
            emulator = self.move_links.get(dst.name)
            up = emulator is not None and f"{dst.name}-link" not in self.down
            return ("127.0.0.1", emulator.port) if up else None  # type: ignore[union-attr]
        return dst.kv

    async def sample(self, prfaas: list[WorkerHandle], now: float) -> LinkReading | None:
        """The link now, or None when there is nothing to read (no emulator yet, or it did not answer)."""
        if not self.emulated:
            infos: dict[str, TcpInfo] = {f"{w.name}/{k}": i for w in prfaas if w.alive for k, i in w.tcp.items()}
            queued = sum(w.queued_bytes for w in prfaas if w.alive)
            health = self._monitor.update(now, infos, queued)
            return LinkReading(health.goodput_bps, self._rate, health.rtt_ms, min(1.0, health.retrans_rate))
        if self.emulator is None:
            return None
        try:
            stats = await self.emulator.control.stats()
        except (OSError, RuntimeError, TimeoutError):
            return None
        self.stats = stats
        fresh, self._uptime = stats.get("uptime_s", 0.0) != self._uptime, stats.get("uptime_s", 0.0)
        egress = 8 * stats["interval_up_bytes"] / stats["interval_s"] if fresh and stats.get("interval_s") else 0.0
        rate = stats["rate_bps"] if stats.get("rate_bps") is not None else math.inf
        return LinkReading(egress, rate)
