"""KV transport benchmarks, every ratio measured side by side in one run.

    python benchmarks/bench_transport.py [--quick] [--json] [--only PART]

1. loopback goodput of the transport vs a plain socket.sendall loop moving the same bytes;
2. goodput through the link emulator at 0.1, 1 and 5 Gbit/s aggregate (and at 5 without payload
   checksums, and with the relay copying bytes instead of splicing them);
3. per-flow cap of 1/4 of the link: 1 vs 4 vs 8 connections;
   and many flows through one slow link: the longest a sender waits for an acknowledgement;
4. pipelining on the tiny default model: time from prefill end to the last byte received, not
   pipelined, by layer, and with chunked prefill (full-attention KV by token chunks), all through
   the prefill worker's own streaming code, on a link whose transfer time equals the prefill time
   (layers replayed at the moments a real prefill produced them: see ``pipelining``).

Receivers run in their own processes (``python benchmarks/netns.py sink``),
the emulator in its own, the sender here. Every figure is the median of the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import torch
from netns import NETNS, SECRET_ENV
from synthetic import bulk_state

from minifaas import figures
from minifaas.emulator.emulator_process import EmulatorProcess
from minifaas.model.layer_state import tensor_bytes
from minifaas.net.channel import Channel
from minifaas.transport.outgoing import KVSender, SenderConfig

SECRET = b"benchmark-secret-0123456789abcdef"
ROWS: list[tuple[str, str, str, str]] = []  # section, case, figure, note
RESULTS: dict[str, Any] = {}


def row(section: str, case: str, figure: str, note: str = "") -> None:
    ROWS.append((section, case, figure, note))
    print(f"  {section:<12} {case:<40} {figure:>16}  {note}", flush=True)


class Peer(NamedTuple):
    port: int
    pid: int


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of this process (all threads) or of process ``pid`` (Linux)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@asynccontextmanager
async def sink() -> AsyncIterator[Peer]:
    """A KV receiver process that takes transfers 0, 1, 2, ... and drops them."""
    argv = [sys.executable, NETNS, "sink", "--listen", "127.0.0.1:0", "--transfers", "0",
            "--accept-unchecked"]  # fmt: skip
    env = {**os.environ, SECRET_ENV: SECRET.decode()}
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, env=env)
    try:
        async with asyncio.timeout(60):
            ready = json.loads(await process.stdout.readline())  # type: ignore[union-attr]
        yield Peer(ready["port"], process.pid)
    finally:
        process.terminate()
        await process.wait()


@asynccontextmanager
async def raw_sink(keep: int = 0) -> AsyncIterator[Peer]:
    """The baseline's receiver: recv_into a buffer until the announced bytes are in, then one byte back.
    With ``keep`` = 0 it reads every block into one hot 4 MiB scratch buffer (the bytes are dropped);
    with ``keep`` bytes it lays them one after another into memory that size, as a receiver that
    keeps the state must (allocated once, used again by every transfer, as the KV receiver's pool)."""
    code = (
        "import socket,struct,sys\n"
        "s=socket.create_server(('127.0.0.1',0));print(s.getsockname()[1],flush=True)\n"
        f"keep={keep};buf=memoryview(bytearray(keep or 4<<20))\n"
        "while True:\n"
        " c,_=s.accept()\n"
        " with c:\n"
        "  n=struct.unpack('<Q',c.recv(8,socket.MSG_WAITALL))[0];at=0\n"
        "  while n>0:\n"
        "   if not keep: at=0\n"
        "   got=c.recv_into(buf[at:],min(n,len(buf)-at));n-=got;at+=got\n"
        "  c.sendall(b'k')\n"
    )
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE)
    try:
        yield Peer(int(await process.stdout.readline()), process.pid)  # type: ignore[union-attr]
    finally:
        process.terminate()
        await process.wait()


class Transfers:
    """Sequential transfer ids for one sink (it takes them in order)."""

    def __init__(self) -> None:
        self.next_id = 0

    def take(self) -> int:
        self.next_id += 1
        return self.next_id - 1


async def timed_send(sender: KVSender, ids: Transfers, state: Any) -> float:
    start = time.perf_counter()
    await sender.send(ids.take(), state)
    return time.perf_counter() - start


def raw_send(port: int, state: Any) -> float:
    views = [tensor_bytes(t) for layer in state.layers for _, t in layer.slots]
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(sum(v.nbytes for v in views).to_bytes(8, "little"))
        for view in views:
            sock.sendall(view)
        assert sock.recv(1) == b"k"
    return time.perf_counter() - start


async def loopback(nbytes: int, repeats: int) -> None:
    state = bulk_state(nbytes)
    variants = {  # name -> sender settings
        "1 connection": {"connections": 1},
        "4 connections": {"connections": 4},
        "1 connection, no payload crc": {"connections": 1, "checksums": False},
        "1 connection, 4 MiB chunks": {"connections": 1, "chunk_bytes": 4 << 20},
    }
    baselines = {"raw": "socket.sendall", "raw_kept": "socket.sendall, kept"}
    times: dict[str, list[float]] = {name: [] for name in [*baselines, *variants]}
    cpu = dict.fromkeys(times, 0.0)  # CPU seconds of sender and receiver together: steadier than time on a busy host
    async with sink() as receiver, raw_sink() as scratch, raw_sink(keep=nbytes) as kept:
        raw_peers = {"raw": scratch, "raw_kept": kept}
        ids = Transfers()
        port = receiver.port
        senders = {name: KVSender(SenderConfig("127.0.0.1", port, SECRET, **kw)) for name, kw in variants.items()}
        for sender in senders.values():  # dial, authenticate and fill the receiver's buffer pool before timing
            await timed_send(sender, ids, state)
        for peer in raw_peers.values():
            await asyncio.to_thread(raw_send, peer.port, state)
        for _ in range(repeats):  # interleaved, so a busy moment hits every variant alike
            for name, peer in raw_peers.items():
                before = cpu_seconds() + cpu_seconds(peer.pid)
                times[name].append(await asyncio.to_thread(raw_send, peer.port, state))
                cpu[name] += cpu_seconds() + cpu_seconds(peer.pid) - before
            for name, sender in senders.items():
                before = cpu_seconds() + cpu_seconds(receiver.pid)
                times[name].append(await timed_send(sender, ids, state))
                cpu[name] += cpu_seconds() + cpu_seconds(receiver.pid) - before
        for sender in senders.values():
            await sender.__aexit__(None, None, None)
    gib = repeats * nbytes / (1 << 30)
    raw, kept_t = statistics.median(times["raw"]), statistics.median(times["raw_kept"])
    for name in baselines:
        cpu[name] = max(cpu[name], 1e-3)  # /proc counts in clock ticks: never divide by a zero reading
    row("loopback", f"socket.sendall, {nbytes >> 20} MiB", f"{8 * nbytes / raw / 1e9:.2f} Gbit/s",
        f"baseline: read into a 4 MiB scratch buffer; {cpu['raw'] / gib:.2f} CPU s/GiB")  # fmt: skip
    row("loopback", "socket.sendall, kept", f"{8 * nbytes / kept_t / 1e9:.2f} Gbit/s",
        f"{raw / kept_t:.2f} of raw; laid into {nbytes >> 20} MiB; {cpu['raw_kept'] / gib:.2f} CPU s/GiB")  # fmt: skip
    RESULTS["loopback_raw_gbps"] = round(8 * nbytes / raw / 1e9, 3)
    RESULTS["loopback_raw_kept_vs_raw"] = round(raw / kept_t, 3)
    for name in variants:
        t = statistics.median(times[name])
        row("loopback", f"transport, {name}", f"{8 * nbytes / t / 1e9:.2f} Gbit/s",
            f"{raw / t:.2f} of raw ({kept_t / t:.2f} of kept); CPU {cpu[name] / cpu['raw']:.2f}x raw's")  # fmt: skip
        key = name.replace(" ", "_").replace(",", "")
        RESULTS[f"loopback_{key}_vs_raw"] = round(raw / t, 3)
        RESULTS[f"loopback_{key}_vs_kept"] = round(kept_t / t, 3)
        RESULTS[f"loopback_{key}_cpu_vs_raw"] = round(cpu[name] / cpu["raw"], 3)


@asynccontextmanager
async def emulated_link(**options: str) -> AsyncIterator[EmulatorProcess]:
    """A sink behind a link emulator started with ``options``; rates are then set over its control port."""
    async with sink() as receiver, EmulatorProcess(("127.0.0.1", receiver.port), **options) as link:
        yield link


async def goodput(link: EmulatorProcess, ids: Transfers, nbytes: int, connections: int, **options: Any) -> float:
    """Bits/s of one transfer of ``nbytes`` through ``link``, on a fresh sender (its own connections);
    ``options``: other SenderConfig fields (checksums, chunk_bytes, ...)."""
    state = bulk_state(nbytes)
    config = SenderConfig("127.0.0.1", link.port, SECRET, connections=connections, done_timeout=120, **options)
    async with KVSender(config) as sender:
        await timed_send(sender, ids, bulk_state(1 << 16))  # connections up first
        return 8 * state.nbytes / await timed_send(sender, ids, state)


async def emulated_rates(rates: list[float], seconds: float) -> None:
    top = max(rates)
    async with emulated_link(rate="none") as link:
        ids = Transfers()
        ceiling = await goodput(link, ids, int(top / 8 * seconds), connections=4)
        RESULTS["emulated_unlimited_gbps"] = round(ceiling / 1e9, 3)
        row("emulated", "no rate limit (this host's ceiling)", f"{ceiling / 1e9:.3f} Gbit/s", "4 connections")
        for rate in rates:
            await link.control.set_rate(rate)
            bps = await goodput(link, ids, int(rate / 8 * seconds), connections=4)
            RESULTS[f"emulated_{rate / 1e9:g}gbps_ratio"] = round(bps / rate, 3)
            row("emulated", f"{rate / 1e9:g} Gbit/s link, 4 connections", f"{bps / 1e9:.3f} Gbit/s",
                f"{bps / rate:.3f} of the link")  # fmt: skip
        no_crc = await goodput(link, ids, int(top / 8 * seconds), connections=4, checksums=False)
    async with emulated_link(rate=f"{top:.0f}", splice="off") as link:
        copying = await goodput(link, Transfers(), int(top / 8 * seconds), connections=4)
    for name, key, bps in (("no payload crc", "no_crc", no_crc), ("relay copying (no splice)", "no_splice", copying)):
        RESULTS[f"emulated_{top / 1e9:g}gbps_{key}_ratio"] = round(bps / top, 3)
        row("emulated", f"{top / 1e9:g} Gbit/s link, {name}", f"{bps / 1e9:.3f} Gbit/s", f"{bps / top:.3f} of the link")


async def flow_caps(rate: float, seconds: float) -> None:
    async with emulated_link(rate=f"{rate:.0f}", flow_rate=f"{rate / 4:.0f}") as link:
        ids = Transfers()
        for connections in (1, 4, 8):
            bps = await goodput(link, ids, int(rate / 8 * seconds), connections)
            RESULTS[f"flowcap_{connections}conn_ratio"] = round(bps / rate, 3)
            row("flow cap", f"cap 1/4 of {rate / 1e6:g} Mbit/s, {connections} conn", f"{bps / 1e6:.1f} Mbit/s",
                f"{bps / rate:.3f} of the link")  # fmt: skip


async def acknowledged_send(port: int, nbytes: int) -> tuple[float, float]:
    """Send ``nbytes`` on a plain connection: (the longest its kernel queue stood still with bytes in it,
    when the queue emptied: every byte acknowledged)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    sending = asyncio.ensure_future(loop.sock_sendall(sock, bytes(nbytes)))
    channel = Channel(sock)  # only to read its kernel send queue
    queued, moved, longest = 0, time.perf_counter(), 0.0
    while not (sending.done() and queued == 0):
        await asyncio.sleep(0.02)
        now, left = time.perf_counter(), channel.queued(write=True)
        if left != queued:
            queued, moved = left, now
        elif left:
            longest = max(longest, now - moved)
    await sending
    sock.close()
    return longest, time.perf_counter()


async def slow_link(flows: int, nbytes: int, rate: float) -> None:
    """Many flows through one slow link, as many PrfaaS transfers at once: how long a sender waits between
    acknowledgements (a KV sender's stall deadline is 10 s), and when the first sees all its bytes acknowledged,
    against the time the link needs to carry them."""

    async def drain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):  # the emulator resets its flows as it stops
            while await reader.read(1 << 16):
                pass
        writer.close()

    server = await asyncio.start_server(drain, "127.0.0.1", 0)
    async with server, EmulatorProcess(server.sockets[0].getsockname()[:2], rate=f"{rate:.0f}") as link:
        started = time.perf_counter()
        sent = await asyncio.gather(*(acknowledged_send(link.port, nbytes) for _ in range(flows)))
    longest, first = max(w for w, _ in sent), min(at for _, at in sent) - started
    link_s = flows * nbytes * 8 / rate
    RESULTS.update(
        {"slowlink_longest_wait_s": round(longest, 2), "slowlink_first_acked_of_link_time": round(first / link_s, 3)}
    )
    case = f"{flows} flows of {nbytes // 1000} KB, {rate / 1e6:g} Mbit/s"
    row("slow link", case, f"{longest:.1f} s", "longest wait between acknowledgements")
    row("slow link", case, f"{first:.1f} s", f"first flow acknowledged whole; the link needs {link_s:.1f} s")


class Recording:
    """Stands in for a transfer during a prefill: notes when each layer or token range was handed over."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.events: list[tuple[float, str, tuple[Any, ...]]] = []

    def put_threadsafe(self, state: Any, start: int = 0, total: int | None = None) -> None:
        self.events.append((time.perf_counter() - self.start, "put", (state, start, total)))


async def replay(recording: Recording, seconds: float, out: Any) -> float:
    """Hand the recorded layers to ``out`` at the recorded moments; returns when the prefill ended."""
    start = time.perf_counter()
    for at, method, args in recording.events:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        getattr(out, method)(*args)
    await asyncio.sleep(max(0.0, start + seconds - time.perf_counter()))
    return time.perf_counter()


def serving_prefill(runtime: Any, ids: list[int], chunk_tokens: int, snapshots: bool, out: Recording) -> float:
    """One prompt through the prefill worker's own streaming code (``PrefixStore.compute`` into a
    ``TransferSink``), with a cold prefix cache (segments at its snapshot points) or none."""
    from minifaas.cache.pool_config import PoolConfig
    from minifaas.model.sampling import GREEDY
    from minifaas.model.state_layout import needs_snapshot
    from minifaas.worker.prefill_service import TransferSink
    from minifaas.worker.prefix_store import PrefixStore

    layout = runtime.layout.kinds
    pool = PoolConfig("bench", 1 << 30, 32, 4, needs_snapshot(layout), enabled=snapshots)  # the worker's defaults
    store = PrefixStore(pool, runtime.spec.name, layout, "bench")
    plan = store.begin(ids)
    if not chunk_tokens:  # as the service does: these segments run before the transfer opens
        store.advance(runtime, plan)
    store.compute(runtime, plan, TransferSink(out, 0, len(ids)), GREEDY, chunk_tokens)  # type: ignore[arg-type]
    return time.perf_counter()


async def pipelining(tokens: int, repeats: int, chunk_tokens: int) -> None:
    """Each repeat runs a real prefill per mode through the prefill worker's streaming code and records
    when each layer (or token range) became final, sets the link so the state takes exactly that
    prefill's time to cross it, then replays the layers at those moments into a real transfer.
    Replaying keeps the host's drifting speed (other work shares its two cores) out of the comparison;
    the live streaming path is in tests."""
    from minifaas.model.runtime import ModelRuntime

    runtime = ModelRuntime.load("kimi-linear-tiny")
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    first = runtime.prefill(ids)  # warm-up
    kv_bytes = first.state.nbytes
    last_share = first.state.layers[-1].nbytes / kv_bytes
    fixed_share = sum(layer.nbytes for layer in first.state.layers if not layer.kind.grows) / kv_bytes
    modes = {  # name -> (pipelined, chunk tokens, prefix cache with snapshots)
        "not pipelined": (False, 0, False),
        "pipelined by layer": (True, 0, False),
        f"chunked prefill, {chunk_tokens} tokens": (True, chunk_tokens, False),
        "worker defaults: chunks of 512, cache on": (True, 512, True),
    }
    ratios: dict[str, list[float]] = {mode: [] for mode in modes}
    prefills: dict[str, list[float]] = {mode: [] for mode in modes}
    async with sink() as receiver, EmulatorProcess(("127.0.0.1", receiver.port)) as link:
        transfers = Transfers()
        for _ in range(repeats):
            for mode, (pipelined, chunk, snapshots) in modes.items():
                recording = Recording()
                end = await asyncio.to_thread(serving_prefill, runtime, ids, chunk, snapshots, recording)
                seconds = end - recording.start
                prefills[mode].append(seconds)
                await link.control.set_rate(8 * kv_bytes / seconds)  # the transfer takes as long as the prefill
                config = SenderConfig("127.0.0.1", link.port, SECRET, connections=4, pipelined=pipelined,
                                      chunk_bytes=64 << 10, done_timeout=300)  # fmt: skip
                async with KVSender(config) as sender:
                    await timed_send(sender, transfers, bulk_state(1 << 12, layers=1))  # connections up first
                    async with sender.stream(transfers.take(), runtime.num_states, kv_bytes) as out:
                        prefill_end = await replay(recording, seconds, out)
                    ratios[mode].append((time.perf_counter() - prefill_end) / seconds)
    row("pipelining", "link = state / prefill time", "", f"{tokens} tokens, {kv_bytes / 1e6:.2f} MB state")
    for mode in modes:
        ratio, prefill = statistics.median(ratios[mode]), statistics.median(prefills[mode])
        row("pipelining", f"prefill end -> last byte, {mode}", f"{ratio:.3f}",
            f"of the transfer time (prefill {prefill:.2f} s)")  # fmt: skip
        key = mode.split(":")[0].replace(",", "").replace(" ", "_")
        RESULTS[f"pipelining_{key}_ratio"] = round(ratio, 3)
    row("pipelining", "share of the state in the last layer", f"{last_share:.3f}", "floor of the by-layer ratio")
    row("pipelining", "share in fixed-size (linear) state", f"{fixed_share:.3f}", "final only after the last token")
    RESULTS.update({"last_layer_share": round(last_share, 3), "fixed_state_share": round(fixed_share, 3)})


async def main(args: argparse.Namespace) -> None:
    quick = args.quick
    parts = {
        "loopback": lambda: loopback(nbytes=(64 if quick else 256) << 20, repeats=3 if quick else 9),
        "emulated": lambda: emulated_rates([0.1e9, 1e9, 5e9], seconds=0.5 if quick else 2.0),
        "flowcap": lambda: flow_caps(rate=400e6, seconds=0.5 if quick else 2.0),
        "slowlink": lambda: slow_link(flows=20 if quick else 80, nbytes=50_000 if quick else 200_000, rate=5e6),
        "pipelining": lambda: pipelining(tokens=512 if quick else 2048, repeats=1 if quick else 3, chunk_tokens=256),
    }
    print(f"  {'section':<12} {'case':<40} {'figure':>16}  note")
    for name, part in parts.items():
        if args.only in (None, name):
            await part()
    if args.json:
        print(figures.dumps(RESULTS))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    parser.add_argument(
        "--only", choices=["loopback", "emulated", "flowcap", "slowlink", "pipelining"], help="run one part"
    )
    asyncio.run(main(parser.parse_args()))
