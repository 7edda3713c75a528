"""The cross-datacenter link emulator: a TCP relay process that every inter-cluster connection crosses.

    python -m minifaas.transport.emulator --target 127.0.0.1:9000 --rate 1gbit \\
        --flow-rate 250mbit --delay-ms 10 --jitter-ms 1 --schedule 0:1gbit,30:200mbit
    minifaas link-emulator ...   (the same)

Each direction of the link has ONE aggregate pacer shared by all flows, like a
real link, plus an optional per-flow pacer (real inter-DC paths often cap one
flow; that is why several connections help). Bytes are paced first, then held
for the one-way delay (with jitter that never reorders a flow). The relay
reads only as fast as the link drains, so TCP backpressure reaches the sender.

On start it prints one JSON line, ``{"port": ..., "control_port": ...}``, then
serves until SIGINT/SIGTERM. The control port takes one JSON object per line
and answers one per line (see ``EmulatorControl``):

    {"cmd": "stats"}                      bytes, flows, rates, utilisation since the last stats
    {"cmd": "cut"}                        reset every connection now
    {"cmd": "stall", "seconds": 2.5}      forward nothing for that long
    {"cmd": "corrupt"}                    flip one byte in the next forwarded chunk (towards the target)
    {"cmd": "rate", "bps": 1e9}           aggregate rate (null: unlimited); also "flow_bps"
    {"cmd": "delay", "ms": 10, "jitter_ms": 1}
    {"cmd": "schedule", "steps": [[0, 1e9], [5, 1e8]]}   rates from now on
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from minifaas.transport.pacer import DelayLine, Pacer, RateSchedule, parse_rate

UP, DOWN = "up", "down"  # up: towards the target (KV direction); down: the replies


@dataclass(frozen=True, slots=True)
class LinkConfig:
    target_host: str
    target_port: int
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    control_host: str = "127.0.0.1"
    control_port: int = 0
    rate_bps: float | None = None
    flow_rate_bps: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    schedule: RateSchedule = field(default_factory=lambda: RateSchedule(()))
    read_bytes: int = 1 << 20
    seed: int = 0

    def __post_init__(self) -> None:
        for rate in (self.rate_bps, self.flow_rate_bps):
            if rate is not None and rate <= 0:
                raise ValueError("rates must be positive (None: unlimited)")
        if self.delay_ms < 0 or not 0 <= self.jitter_ms <= max(self.delay_ms, 0):
            raise ValueError("need delay_ms >= 0 and 0 <= jitter_ms <= delay_ms")
        if self.read_bytes < 1024:
            raise ValueError("read_bytes must be at least 1 KiB")


class _Flow:
    def __init__(self, flow_id: int, client: socket.socket, flow_rate: float | None, rng: random.Random):
        self.id = flow_id
        self.client = client
        self.upstream: socket.socket | None = None
        self.pacers = {UP: Pacer(flow_rate), DOWN: Pacer(flow_rate)}
        self.delays = {UP: DelayLine(rng), DOWN: DelayLine(rng)}

    def close(self, reset: bool) -> None:
        """Close both sides; ``reset`` sends RSTs (a cut) instead of an orderly close."""
        for sock in (self.client, self.upstream):
            if sock is not None and sock.fileno() >= 0:
                if reset:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                sock.close()


class LinkEmulator:
    def __init__(self, config: LinkConfig):
        self.config = config
        c = config
        self.link = {UP: Pacer(c.rate_bps), DOWN: Pacer(c.rate_bps)}
        self.flow_rate_bps = c.flow_rate_bps
        self.delay_s, self.jitter_s = c.delay_ms / 1000, c.jitter_ms / 1000
        self.bytes = {UP: 0, DOWN: 0}
        self.flows: dict[int, tuple[_Flow, asyncio.Task[None]]] = {}
        self.flows_total = self.cuts = self.corrupt_pending = 0
        self._rng = random.Random(c.seed)
        self._stalled_until = 0.0
        self._last_stats = (0.0, 0)
        peak = max([r for r in (c.rate_bps, *(r for _, r in c.schedule.steps)) if r is not None], default=1e10)
        in_flight = peak / 8 * (self.delay_s + self.jitter_s + 0.02)
        self._queue_items = max(16, math.ceil(in_flight / c.read_bytes) + 4)
        self._group = asyncio.TaskGroup()
        self._servers: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        return self._servers[0].getsockname()[1]

    @property
    def control_port(self) -> int:
        return self._servers[1].getsockname()[1]

    async def __aenter__(self) -> LinkEmulator:
        c = self.config
        for host, port in ((c.listen_host, c.listen_port), (c.control_host, c.control_port)):
            server = socket.create_server((host, port), backlog=128)
            server.setblocking(False)
            self._servers.append(server)
        await self._group.__aenter__()
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._last_stats = (self._started, 0)
        self._spawn(self._accept(self._servers[0], self._relay))
        self._spawn(self._accept(self._servers[1], self._control))
        self._schedule = self._spawn(self._follow_schedule(c.schedule, self._started))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        await self._group.__aexit__(None, None, None)
        for server in self._servers:
            server.close()

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = self._group.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept(self, server: socket.socket, handler: Any) -> None:
        while True:
            sock, _ = await self._loop.sock_accept(server)
            sock.setblocking(False)
            self._spawn(handler(sock))

    async def _relay(self, client: socket.socket) -> None:
        self.flows_total += 1
        flow = _Flow(self.flows_total, client, self.flow_rate_bps, self._rng)
        task = asyncio.current_task()
        assert task is not None
        self.flows[flow.id] = (flow, task)
        try:
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            flow.upstream = upstream
            upstream.setblocking(False)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.timeout(10):
                await self._loop.sock_connect(upstream, (self.config.target_host, self.config.target_port))
            async with asyncio.TaskGroup() as tg:
                for direction, src, dst in ((UP, client, upstream), (DOWN, upstream, client)):
                    queue: asyncio.Queue[tuple[float, bytearray, int]] = asyncio.Queue(self._queue_items)
                    free: list[bytearray] = []
                    tg.create_task(self._pace(flow, direction, src, queue, free))
                    tg.create_task(self._deliver(dst, queue, free))
            flow.close(reset=False)
        except (OSError, TimeoutError, BaseExceptionGroup):
            await self._while_stalled()  # a stalled link carries no resets either
            flow.close(reset=True)  # one side broke: pass the break on to the other
        finally:
            flow.close(reset=True)  # no-op unless cancelled (a cut)
            self.flows.pop(flow.id, None)

    async def _pace(self, flow: _Flow, direction: str, src: socket.socket, queue: asyncio.Queue, free: list) -> None:
        while True:
            await self._while_stalled()
            buf = free.pop() if free else bytearray(self.config.read_bytes)  # recycled: no page faults per read
            n = await self._loop.sock_recv_into(src, memoryview(buf)[: self._read_size(flow, direction)])
            if n == 0:
                await queue.put(
                    (flow.delays[direction].release_time(self._loop.time(), self.delay_s, self.jitter_s), buf, 0)
                )
                return
            now = self._loop.time()
            # the flow's own bottleneck and the shared link carry the same bytes at the same time
            wait = max(flow.pacers[direction].reserve(n, now), self.link[direction].reserve(n, now))
            if wait > 0:
                await asyncio.sleep(wait)
            if direction == UP and self.corrupt_pending:
                self.corrupt_pending -= 1
                buf[n // 2] ^= 0xFF
            self.bytes[direction] += n
            release_at = flow.delays[direction].release_time(self._loop.time(), self.delay_s, self.jitter_s)
            await queue.put((release_at, buf, n))

    def _read_size(self, flow: _Flow, direction: str) -> int:
        """About 2 ms of the slowest rate on the path: bytes cross a slow link in small steps, not in one MiB."""
        rates = [r for r in (flow.pacers[direction].rate_bps, self.link[direction].rate_bps) if r is not None]
        if not rates:
            return self.config.read_bytes
        return max(1500, min(self.config.read_bytes, int(min(rates) / 8 * 0.002)))

    async def _deliver(self, dst: socket.socket, queue: asyncio.Queue, free: list) -> None:
        while True:
            release_at, buf, n = await queue.get()
            if (wait := release_at - self._loop.time()) > 0:
                await asyncio.sleep(wait)
            await self._while_stalled()
            if n == 0:
                dst.shutdown(socket.SHUT_WR)
                return
            await self._loop.sock_sendall(dst, memoryview(buf)[:n])
            free.append(buf)

    async def _while_stalled(self) -> None:
        while (left := self._stalled_until - self._loop.time()) > 0:
            await asyncio.sleep(left)

    async def _follow_schedule(self, schedule: RateSchedule, origin: float) -> None:
        for at, rate in schedule.steps:
            await asyncio.sleep(max(0.0, origin + at - self._loop.time()))
            self.set_rate(rate)

    # --- faults and settings, also reachable over the control port ---

    def cut(self) -> None:
        self.cuts += 1
        for _, task in list(self.flows.values()):
            task.cancel()  # its finally resets both sides

    def stall(self, seconds: float) -> None:
        self._stalled_until = max(self._stalled_until, self._loop.time() + seconds)

    def set_rate(self, bps: float | None) -> None:
        for pacer in self.link.values():
            pacer.set_rate(bps)

    def set_flow_rate(self, bps: float | None) -> None:
        self.flow_rate_bps = bps
        for flow, _ in self.flows.values():
            for pacer in flow.pacers.values():
                pacer.set_rate(bps)

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
            "delay_ms": self.delay_s * 1000,
            "jitter_ms": self.jitter_s * 1000,
            "flows": len(self.flows),
            "flows_total": self.flows_total,
            "cuts": self.cuts,
            "stalled": self._stalled_until > now,
            "uptime_s": now - self._started,
        }

    def command(self, request: dict[str, Any]) -> dict[str, Any]:
        cmd = request.get("cmd")
        if cmd == "stats":
            return self.stats()
        if cmd == "cut":
            self.cut()
        elif cmd == "stall":
            self.stall(float(request["seconds"]))
        elif cmd == "corrupt":
            self.corrupt_pending += 1
        elif cmd == "rate":
            if "bps" in request:
                self.set_rate(request["bps"])
            if "flow_bps" in request:
                self.set_flow_rate(request["flow_bps"])
        elif cmd == "delay":
            self.delay_s, self.jitter_s = float(request["ms"]) / 1000, float(request.get("jitter_ms", 0)) / 1000
        elif cmd == "schedule":
            steps = RateSchedule(tuple((float(t), r) for t, r in request["steps"]))
            self._schedule.cancel()  # a new schedule replaces the old one
            self._schedule = self._spawn(self._follow_schedule(steps, self._loop.time()))
        else:
            raise ValueError(f"unknown command {cmd!r}")
        return {}

    async def _control(self, sock: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            while line := await reader.readline():
                try:
                    reply = {"ok": True, **self.command(json.loads(line))}
                except (ValueError, KeyError, TypeError) as e:
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="HOST:PORT the relay forwards to (the receiver)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT for senders (port 0: any)")
    parser.add_argument("--control", default="127.0.0.1:0", help="HOST:PORT of the JSON-lines control port")
    parser.add_argument("--rate", default="none", help="aggregate rate per direction, e.g. 1gbit (default: none)")
    parser.add_argument("--flow-rate", default="none", help="cap of one flow, e.g. 250mbit (default: none)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform +- jitter on the delay")
    parser.add_argument("--schedule", default="", help="rate steps SECONDS:RATE,..., e.g. 0:1gbit,10:100mbit")
    parser.add_argument("--read-bytes", type=int, default=1 << 20, help="relay read size")
    parser.add_argument("--seed", type=int, default=0, help="jitter seed")


def run(args: argparse.Namespace) -> int:
    (target_host, target_port), listen, control = _address(args.target), _address(args.listen), _address(args.control)
    config = LinkConfig(
        target_host, target_port, listen[0], listen[1], control[0], control[1], parse_rate(args.rate),
        parse_rate(args.flow_rate), args.delay_ms, args.jitter_ms, RateSchedule.parse(args.schedule),
        args.read_bytes, args.seed,
    )  # fmt: skip
    return asyncio.run(_serve(config))


async def _serve(config: LinkConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with LinkEmulator(config) as link:
        print(json.dumps({"port": link.port, "control_port": link.control_port}), flush=True)
        await stop.wait()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m minifaas.transport.emulator", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
