"""The link emulator's relay: every flow through it crosses one emulated inter-datacenter link.

Each direction has one pacer shared by all flows, like a real link, and optionally a rate cap and a window per
flow. A flow's bytes wait for room in its window, then for both pacers, then for the one-way delay. The relay
reads only as fast as the link drains and its sockets buffer little, so bytes a flow cannot send yet wait in the
sender's own socket, as before a real link.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import socket
from dataclasses import dataclass, field
from typing import Any

from minifaas.emulator.pacer import FlowWindow, Pacer, RateSchedule, check_window
from minifaas.emulator.relay_blocks import Block, CopiedBlock, SplicedBlock, splice_available
from minifaas.emulator.relay_flow import DOWN, UP, Flow

_MIN_SOCKET_BUFFER = 8 << 10  # a few small segments; and never under one of the socket's own (see _bound_buffers)


@dataclass(frozen=True, slots=True)
class RelayConfig:
    target_host: str
    target_port: int
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    rate_bps: float | None = None
    flow_rate_bps: float | None = None
    window_bytes: int | None = None  # bytes in flight per flow and direction (None: no window)
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    schedule: RateSchedule = field(default_factory=lambda: RateSchedule(()))
    read_bytes: int = 1 << 20
    seed: int = 0
    splice: bool = True  # move bytes with splice(2) where the platform has it; False: copy them

    @property
    def uses_splice(self) -> bool:
        return self.splice and splice_available()

    def __post_init__(self) -> None:
        for rate in (self.rate_bps, self.flow_rate_bps):
            if rate is not None and rate <= 0:
                raise ValueError("rates must be positive (None: unlimited)")
        if self.delay_ms < 0 or not 0 <= self.jitter_ms <= max(self.delay_ms, 0):
            raise ValueError("need delay_ms >= 0 and 0 <= jitter_ms <= delay_ms")
        if self.read_bytes < 1024:
            raise ValueError("read_bytes must be at least 1 KiB")
        check_window(self.window_bytes)


class LinkEmulator:
    def __init__(self, config: RelayConfig):
        self.config = config
        c = config
        self.link = {UP: Pacer(c.rate_bps), DOWN: Pacer(c.rate_bps)}
        self.flow_rate_bps = c.flow_rate_bps
        self.window_bytes = c.window_bytes
        self.delay_s, self.jitter_s = c.delay_ms / 1000, c.jitter_ms / 1000
        self.bytes = {UP: 0, DOWN: 0}
        self.flows: dict[int, tuple[Flow, asyncio.Task[None]]] = {}
        self.flows_total = self.cuts = self.corrupt_pending = 0
        self._rng = random.Random(c.seed)
        self._stalled_until = 0.0
        self._stall_changed = asyncio.Event()
        self._last_stats = (0.0, 0)
        peak = max([r for r in (c.rate_bps, *(r for _, r in c.schedule.steps)) if r is not None], default=1e10)
        in_flight = peak / 8 * (self.delay_s + self.jitter_s + 0.02)
        self._queue_items = max(16, math.ceil(in_flight / c.read_bytes) + 4)
        self._group = asyncio.TaskGroup()
        self._routes: dict[int, tuple[socket.socket, tuple[str, int], asyncio.Task[None]]] = {}  # listen port ->
        self._port = 0  # the first route's
        self._paced_listeners: set[socket.socket] = set()  # given segments and buffers (_bound_listener)
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """Where senders connect for the first target (``config.target_*``)."""
        return self._port

    async def __aenter__(self) -> LinkEmulator:
        c = self.config
        await self._group.__aenter__()
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._last_stats = (self._started, 0)
        self._port = self.add_route(c.target_host, c.target_port, c.listen_port)
        self._schedule = self._spawn(self._follow_schedule(c.schedule, self._started))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        await self._group.__aexit__(None, None, None)
        for server, _, _ in self._routes.values():
            server.close()

    def add_route(self, host: str, port: int, listen_port: int = 0) -> int:
        """Carry flows to another target over the same link (the same pacers, delay and faults): senders
        reach it on the listening port this returns. A cluster with several receivers shares one link so."""
        host = self.config.listen_host
        server = socket.create_server((host, listen_port), family=_family(host), backlog=128)
        server.setblocking(False)
        self._bound_listener(server)
        bound = server.getsockname()[1]
        self._routes[bound] = (server, (host, port), self._spawn(self._accept(server, (host, port))))
        return bound

    @property
    def routes(self) -> dict[int, tuple[str, int]]:
        """Listening port -> the target its flows go to."""
        return {port: target for port, (_, target, _) in self._routes.items()}

    def remove_route(self, listen_port: int) -> None:
        """Stop taking new flows on ``listen_port`` (its accept loop closes the socket); flows on it run to the end."""
        if listen_port not in self._routes:
            raise ValueError(f"no route listens on port {listen_port}")
        server, _, accepting = self._routes.pop(listen_port)
        accepting.cancel()
        self._paced_listeners.discard(server)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = self._group.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept(self, server: socket.socket, target: tuple[str, int]) -> None:
        try:
            while True:
                sock, _ = await self._loop.sock_accept(server)
                sock.setblocking(False)
                self._spawn(self._relay(sock, target))
        finally:
            # closed only now that the event loop no longer watches it: closed sooner, its descriptor could go
            # to a new flow's socket, which the loop's stale entry would then refuse (the flow reset)
            server.close()

    async def _relay(self, client: socket.socket, target: tuple[str, int]) -> None:
        self.flows_total += 1
        flow = Flow(self.flows_total, client, self.flow_rate_bps, self.window_bytes, self._rng)
        task = asyncio.current_task()
        assert task is not None
        self.flows[flow.id] = (flow, task)
        try:
            upstream = socket.socket(_family(target[0]), socket.SOCK_STREAM)
            flow.upstream = upstream
            upstream.setblocking(False)
            _segments_of(upstream, self._read_size(flow, DOWN))
            self._bound_buffers(flow)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.timeout(10):
                await self._loop.sock_connect(upstream, target)
            async with asyncio.TaskGroup() as tg:
                for direction, src, dst in ((UP, client, upstream), (DOWN, upstream, client)):
                    queue: asyncio.Queue[tuple[float, Block, int]] = asyncio.Queue(self._queue_items)
                    free: list[Block] = []
                    tg.create_task(self._pace(flow, direction, src, queue, free))
                    tg.create_task(self._deliver(dst, queue, free))
            flow.close(reset=False)
        except (OSError, TimeoutError, BaseExceptionGroup):
            await self._while_stalled()  # a stalled link carries no resets either
            flow.close(reset=True)  # one side broke: pass the break on to the other
        finally:
            flow.close(reset=True)  # no-op unless cancelled (a cut)
            self.flows.pop(flow.id, None)

    async def _pace(self, flow: Flow, direction: str, src: socket.socket, queue: asyncio.Queue, free: list) -> None:
        window = flow.windows[direction]
        while True:
            await self._while_stalled()
            room = await self._window_room(window)
            block = free.pop() if free else self._new_block(flow)  # recycled: no page faults, no new pipes
            size = self._read_size(flow, direction)
            n = await block.fill(src, size if room is None else min(size, room))
            if n == 0:
                await queue.put(
                    (flow.delays[direction].release_time(self._loop.time(), self.delay_s, self.jitter_s), block, 0)
                )
                return
            now = self._loop.time()
            # the flow's own bottleneck and the shared link carry the same bytes at the same time
            wait = max(flow.pacers[direction].reserve(n, now), self.link[direction].reserve(n, now))
            if wait > 0:
                await asyncio.sleep(wait)
            if direction == UP and self.corrupt_pending:
                self.corrupt_pending -= 1
                block.flip_byte(n // 2)
            self.bytes[direction] += n
            release_at = flow.delays[direction].release_time(self._loop.time(), self.delay_s, self.jitter_s)
            window.sent(n, release_at + self.delay_s)  # arrived, and its acknowledgement back one way later
            await queue.put((release_at, block, n))

    async def _window_room(self, window: FlowWindow) -> int | None:
        """Wait until the flow's window has room again (a window can shrink while bytes are in flight)."""
        while (room := window.room(self._loop.time())) == 0:
            acked_at = window.next_ack()
            await asyncio.sleep(0.001 if acked_at is None else max(0.0, acked_at - self._loop.time()))
        return room

    def _new_block(self, flow: Flow) -> Block:
        size = self.config.read_bytes
        block: Block = SplicedBlock(size) if self.config.uses_splice else CopiedBlock(size)
        flow.blocks.append(block)
        return block

    def _read_size(self, flow: Flow | None, direction: str) -> int:
        """A read's bytes (a new flow's with no ``flow``): a small step of the slowest rate on the path, and a fraction
        of the flow's window, since a block is acknowledged whole and a window read in one would stall a round trip."""
        size = self.config.read_bytes
        flow_rate = self.flow_rate_bps if flow is None else flow.pacers[direction].rate_bps
        rates = [r for r in (flow_rate, self.link[direction].rate_bps) if r is not None]
        if rates:
            size = min(size, int(min(rates) / 8 * 0.002))
        window = self.window_bytes if flow is None else flow.windows[direction].window_bytes
        if window is not None:
            size = min(size, window // 8)
        return max(1500, size)

    def _bound_buffers(self, flow: Flow) -> None:
        """Let each of the flow's sockets take in two reads' worth, or one of its segments, so a slow flow's bytes
        wait in the sender's socket, where its unsent budget sees them, not in a buffer the kernel grows. Sized
        again as the rate or window changes; a direction with neither keeps the kernel's sizing, the fastest."""
        for direction, sock in zip((UP, DOWN), flow.sockets, strict=True):
            read = self._read_size(flow, direction)
            if sock is None or sock.fileno() < 0 or (read >= self.config.read_bytes and direction not in flow.bounded):
                continue
            segment = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, max(_MIN_SOCKET_BUFFER, 2 * read, segment))
            flow.bounded.add(direction)

    def _bound_listener(self, server: socket.socket) -> None:
        """Size a listening socket's new flows as ``_bound_buffers`` would, from their first byte, with segments of
        one read: the kernel acknowledges a slow flow's bytes as a segment's room frees, on loopback 64 KB."""
        read = self._read_size(None, UP)
        if read < self.config.read_bytes or server in self._paced_listeners:  # else the kernel's sizing
            self._paced_listeners.add(server)
            _segments_of(server, read)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, max(_MIN_SOCKET_BUFFER, 2 * read))

    async def _deliver(self, dst: socket.socket, queue: asyncio.Queue, free: list) -> None:
        while True:
            release_at, block, n = await queue.get()
            if (wait := release_at - self._loop.time()) > 0:
                await asyncio.sleep(wait)
            await self._while_stalled()
            if n == 0:
                dst.shutdown(socket.SHUT_WR)
                return
            await block.drain(dst)
            free.append(block)

    async def _while_stalled(self) -> None:
        # bounded by the stall (at most link_commands.MAX_STALL_S), and a later, shorter one
        # (``stall 0``) wakes it at once
        while (left := self._stalled_until - self._loop.time()) > 0:
            self._stall_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._stall_changed.wait()

    async def _follow_schedule(self, schedule: RateSchedule, origin: float) -> None:
        for at, rate in schedule.steps:
            await asyncio.sleep(max(0.0, origin + at - self._loop.time()))
            self.set_rate(rate)

    # --- faults and settings (the emulator process exposes them on its control port) ---

    def cut(self) -> None:
        self.cuts += 1
        for _, task in list(self.flows.values()):
            task.cancel()  # its finally resets both sides

    def stall(self, seconds: float) -> None:
        """Forward nothing for ``seconds`` from now, replacing any stall before (0: end it)."""
        if not 0 <= seconds < math.inf:
            raise ValueError(f"a stall of {seconds} s")
        self._stalled_until = self._loop.time() + seconds
        self._stall_changed.set()

    def set_rate(self, bps: float | None) -> None:
        for pacer in self.link.values():
            pacer.set_rate(bps)
        self._bound_all_buffers()

    def _bound_all_buffers(self) -> None:
        for server, _, _ in self._routes.values():
            self._bound_listener(server)
        for flow, _ in self.flows.values():
            self._bound_buffers(flow)

    def set_schedule(self, schedule: RateSchedule) -> None:
        """Rate steps from now on, replacing any schedule still running."""
        self._schedule.cancel()
        self._schedule = self._spawn(self._follow_schedule(schedule, self._loop.time()))

    def set_delay(self, delay_ms: float, jitter_ms: float = 0.0) -> None:
        if delay_ms < 0 or not 0 <= jitter_ms <= delay_ms:
            raise ValueError("need delay_ms >= 0 and 0 <= jitter_ms <= delay_ms")
        self.delay_s, self.jitter_s = delay_ms / 1000, jitter_ms / 1000

    def set_flow_rate(self, bps: float | None) -> None:
        self.flow_rate_bps = bps
        for flow, _ in self.flows.values():
            for pacer in flow.pacers.values():
                pacer.set_rate(bps)
        self._bound_all_buffers()

    def set_window(self, window_bytes: int | None) -> None:
        """Bytes in flight per flow and direction, for new flows and those running (None: no window)."""
        self.window_bytes = check_window(window_bytes)
        for flow, _ in self.flows.values():
            for window in flow.windows.values():
                window.set_window(window_bytes)
        self._bound_all_buffers()

    def stats(self) -> dict[str, Any]:
        now = self._loop.time()
        since, bytes_then = self._last_stats
        self._last_stats = (now, self.bytes[UP])
        rate = self.link[UP].rate_bps
        sent = self.bytes[UP] - bytes_then
        return {
            "up_bytes": self.bytes[UP],
            "down_bytes": self.bytes[DOWN],
            "interval_s": now - since,
            "interval_up_bytes": sent,
            "utilisation": 8 * sent / (rate * (now - since)) if rate and now > since else None,
            "rate_bps": rate,
            "flow_rate_bps": self.flow_rate_bps,
            "window_bytes": self.window_bytes,
            "delay_ms": self.delay_s * 1000,
            "jitter_ms": self.jitter_s * 1000,
            "flows": len(self.flows),
            "flows_total": self.flows_total,
            "cuts": self.cuts,
            "stalled": self._stalled_until > now,
            "uptime_s": now - self._started,
            "routes": {str(port): f"{host}:{to}" for port, (_, (host, to), _) in self._routes.items()},
        }


def _segments_of(sock: socket.socket, read: int) -> None:
    """Before it connects, ``sock`` asks for segments of ``read`` bytes (TCP takes up to 32767; else its path's)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, read if read < 32767 else 0)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
