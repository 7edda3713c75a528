"""The PrfaaS -> PD link as the gateway uses it: emulated beside the gateway, or the real network.

Emulated (the default when every worker is a local child): one link emulator
process, a route (a listening port of its own) to each decode worker's KV
port and one pacer for all of them, so the PrfaaS egress shares one ceiling
however many decode workers there are; with cache moves, one more emulator in
front of each prefill worker's move receiver. Its counters are the link's
reading. Only state from the PrfaaS cluster goes through it.

Real (``[link] emulated = false``, and whenever workers run elsewhere): KV goes
straight to each decode worker's advertised address, and the reading comes
from the kernel. Every PrfaaS worker reports the TCP_INFO of its KV
connections with each pong; one ``LinkMonitor`` turns the growth of their
counters into egress, rtt and retransmissions for the scheduler, and
``rate`` is taken as the link's known capacity ("none": unknown). Through the
emulator the connections end at the relay on loopback, so their rtt says
nothing about the link: that is why the emulated reading leaves it at zero.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

from minifaas.serve.config import LinkConfig
from minifaas.serve.startup import StartupListener, reported
from minifaas.serve.worker_handle import WorkerHandle
from minifaas.transport.emulator_control import EmulatorControl, EmulatorError, EmulatorProcess
from minifaas.transport.link_health import LinkMonitor, TcpInfo
from minifaas.transport.pacer import parse_rate

NAME = "prfaas->pd"  # the inter-cluster link's name in /metrics


@dataclass(frozen=True, slots=True)
class LinkReading:
    egress_bps: float  # PrfaaS egress since the previous reading (0 when nothing new was measured)
    rate_bps: float  # the ceiling now: inf when unlimited or unknown, 0 when cut
    rtt_ms: float = 0.0  # mean smoothed rtt of the KV connections; 0: not measured
    retrans_rate: float = 0.0  # retransmitted / sent bytes since the previous reading

    @property
    def utilisation(self) -> float:
        return self.egress_bps / self.rate_bps if 0 < self.rate_bps < math.inf else 0.0


class InterClusterLink:
    def __init__(self, config: LinkConfig, emulated: bool, moves: bool) -> None:
        self.config, self.emulated, self.moves = config, emulated, moves
        self.emulator: EmulatorProcess | None = None  # PrfaaS -> PD: every PrfaaS state crosses it
        self.routes: dict[str, int] = {}  # decode worker -> the emulator's port that leads to its KV port
        self.move_links: dict[str, EmulatorProcess] = {}  # the link into each prefill node, for cache moves
        self.stats: dict = {}  # the emulator's last counters
        self._uptime = -1.0  # of the counters last read, so a stale reading counts no egress
        rate = parse_rate(config.rate)
        self._monitor = LinkMonitor(rate or 1.0)
        self._rate = rate or math.inf
        self.on_startup: StartupListener | None = None  # told of each emulator starting and ready; None: the log
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> InterClusterLink:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    @property
    def control(self) -> EmulatorControl:
        """The emulator's control port (rate changes, stalls, cuts); emulated links only."""
        if self.emulator is None:
            raise RuntimeError("the link is not emulated (or no decode worker is up yet)")
        return self.emulator.control

    def _options(self) -> dict[str, object]:
        c = self.config
        return {
            "rate": c.rate,
            "flow_rate": c.flow_rate,
            "window": c.window,
            "delay_ms": c.delay_ms,
            "jitter_ms": c.jitter_ms,
        }

    async def join(self, w: WorkerHandle) -> None:
        """Put the emulated link in front of what crosses clusters into ``w`` (once; it keeps its KV port)."""
        if not self.emulated or w.kv is None:
            return
        if w.role == "decode" and w.name not in self.routes:
            if self.emulator is None:  # the link starts with the first decode worker
                entered = self._stack.enter_async_context(EmulatorProcess(w.kv, **self._options()))
                self.emulator = await reported(self.on_startup, NAME, f"link emulator, {self.config.rate}", entered)
                self.routes[w.name] = self.emulator.port
            else:
                self.routes[w.name] = await self.emulator.control.add_route(w.kv)
        elif w.role == "prefill" and self.moves and w.name not in self.move_links:
            entered = self._stack.enter_async_context(EmulatorProcess(w.kv, **self._options()))
            what = "link emulator for cache moves"
            self.move_links[w.name] = await reported(self.on_startup, f"{w.name}-link", what, entered)

    async def leave(self, w: WorkerHandle) -> None:
        port = self.routes.pop(w.name, None)
        if port is not None and self.emulator is not None:
            with contextlib.suppress(EmulatorError, OSError, TimeoutError):
                await self.emulator.control.remove_route(port)
        emulator = self.move_links.pop(w.name, None)
        if emulator is not None:
            await emulator.__aexit__(None, None, None)

    def kv_address(self, prefill: WorkerHandle, decode: WorkerHandle) -> list:
        """Where ``prefill`` sends KV for ``decode``: through the emulator when it crosses clusters."""
        assert decode.kv is not None
        if prefill.cluster == "prfaas" and self.emulated:
            return ["127.0.0.1", self.routes[decode.name]]
        return list(decode.kv)

    def move_address(self, dst: WorkerHandle) -> list | None:
        """Where a cache move into ``dst`` goes, or None if ``dst`` takes none."""
        if dst.kv is None:
            return None
        if self.emulated:
            emulator = self.move_links.get(dst.name)
            return ["127.0.0.1", emulator.port] if emulator is not None else None
        return list(dst.kv)

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
