"""The KV link at a real WAN's round trip: goodput by connection count, and layer pipelining, at 5 and 30 ms RTT.

    python benchmarks/bench_wan.py [--quick] [--json] [--only emulator|netns]
                                   [--rtts 5,30] [--counts 1,4,8,16] [--repeats N] [--goodput-only]

The link being stood in for: a cross-datacenter link measured at 14.7 Gbit/s
and 30 ms RTT, crossed by untuned Linux hosts, whose connections each keep at
most 4 MiB in flight (net.ipv4.tcp_wmem). This machine cannot move 14.7
Gbit/s, so the rate is scaled down, and every size that is a time on the link
with it: at rate R, R / 14.7 Gbit/s of the window (4 MiB per connection), of
the sender's chunk (1 MiB) and of its unsent budget (4 MiB). That keeps the
number of connections the link needs, ceil(R * RTT / (8 * window)), what it
is on the real link (14 at 30 ms, 3 at 5 ms), and a chunk a quarter of a
window, as there.

1. emulator: the link emulator at ``--emulator-rate`` (1 Gbit/s) with that
   window per flow and half the RTT each way; goodput of one transfer for
   1, 4, 8 and 16 connections (16 is the default), beside what the windows
   allow, min(1, N * window * 8 / (R * RTT)).
2. pipelining, through the emulator: a long prompt on the kimi-linear-tiny preset
   through the prefill worker's own streaming code, its layers replayed into a
   real transfer at the moments the prefill produced them (bench_transport's
   method), but ``k`` times faster, as a faster prefill of the same shape, so
   that the link that makes the transfer take as long as the prefill runs at
   ``--pipeline-rate`` (50 Mbit/s; a CPU prefill's own pace would be a few
   Mbit/s, thinner than sixteen connections' smallest windows). No window
   here: sixteen of the real link's windows fill it with room to spare, and in
   the emulator a window would leave the ~128 KB each connection has in the
   relay's loopback buffers draining at one window per round trip, a stage
   the real link does not have (its senders hold only their window and their
   unsent share). The time from prefill end to the receiver's DONE and the
   TTFT it makes (prefill plus that), not pipelined, by layer, and with the
   worker's defaults (chunked prefill). Goal: pipelined, prefill end to last
   byte within one RTT + 0.15x the transfer time T (DONE comes half an RTT
   after the last byte: a stricter test).
3. netns (root): the same two through two network namespaces, where the
   kernel's own TCP meets a tbf bottleneck at ``--netns-rate`` (200 Mbit/s,
   what a user-space return path keeps up with here) of TCP payload, as the
   emulator paces and as a transfer tool measures a link (tbf paces frames,
   so it is set 1514/1448 higher: a full segment's headers), the sender's
   chunk and unsent budget scaled as in 1, the receiver advertising
   about the scaled window (a route's window metric; the kernel holds it a
   little above, and not below about 60 KB) and the RTT made in user space on
   the return path (``minifaas.transport.netns_delay``: this kernel has no
   netem). The kernel's own RTT reading (TCP_INFO) is shown beside. The tbf
   row with no RTT and no window is what this host's tbf carries. Pipelining
   there runs with the kernel's own windows.

Every figure is the median of the repeats; the load average is printed first,
since two shared cores move all of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_transport import SECRET, Recording, Transfers, goodput, replay, serving_prefill, sink, timed_send
from netns import NETNS, SECRET_ENV, NetnsLink, run_pair, unavailable
from synthetic import bulk_state

from minifaas.commands.arguments import positive, positive_int, positive_ints
from minifaas.emulator.emulator_process import EmulatorProcess
from minifaas.net.connections import DEFAULT_CONNECTIONS
from minifaas.transport.outgoing import MIN_UNSENT_BYTES, KVSender, SenderConfig

FRAME_BYTES, SEGMENT_PAYLOAD_BYTES = 1514, 1448  # a full TCP segment on the veth (MTU 1500), and its payload
REAL_RATE, REAL_WINDOW = 14.7e9, 4 << 20  # the link and the per-connection window being stood in for
MODEL = "kimi-linear-tiny"  # a seeded preset, as bench_transport: its last layer (MLA) sets the by-layer floor
_DEFAULTS = SenderConfig("h", 1, SECRET)
RESULTS: dict[str, Any] = {}
MODES = {  # name -> (pipelined, chunk tokens, prefix cache with snapshots)
    "not pipelined": (False, 0, False),
    "pipelined by layer": (True, 0, False),
    "worker defaults": (True, 512, True),
}


def row(section: str, case: str, figure: str, note: str = "") -> None:
    print(f"  {section:<14} {case:<42} {figure:>15}  {note}", flush=True)


def scaled_window(rate: float) -> int:
    return int(REAL_WINDOW * rate / REAL_RATE)


def scaled_sender(rate: float) -> dict[str, int]:
    """The sender's chunk and unsent budget, scaled as the window is (their defaults are sized for real links)."""
    assert _DEFAULTS.unsent_bytes is not None
    return {
        "chunk_bytes": int(_DEFAULTS.chunk_bytes * rate / REAL_RATE),
        "unsent_bytes": max(MIN_UNSENT_BYTES, int(_DEFAULTS.unsent_bytes * rate / REAL_RATE)),
    }


def window_bound(connections: int, window: int, rate: float, rtt: float) -> float:
    """The share of the link that ``connections`` windows can keep busy."""
    return min(1.0, connections * window * 8 / (rate * rtt))


def needed(rate: float, rtt: float, window: int) -> int:
    return math.ceil(rate * rtt / (8 * window))


def key(*parts: object) -> str:
    return "_".join(str(p).replace(" ", "_").replace(".", "p") for p in parts)


# --- 1. goodput through the emulator ---


async def emulator_goodput(rate: float, rtts: list[float], counts: list[int], seconds: float, repeats: int) -> None:
    window = scaled_window(rate)
    async with sink() as receiver, EmulatorProcess(("127.0.0.1", receiver.port), rate=f"{rate:.0f}",
                                                   window=str(window)) as link:  # fmt: skip
        ids = Transfers()
        for rtt in rtts:
            await link.control.set_delay(rtt * 1000 / 2)
            row("emulator", f"{rate / 1e9:g} Gbit/s, RTT {rtt * 1000:g} ms, window {window / 1e3:.0f} KB",
                f"{needed(rate, rtt, window)} needed", "connections: ceil(rate * RTT / (8 * window))")  # fmt: skip
            for n in counts:
                bound = window_bound(n, window, rate, rtt)
                nbytes = int(rate * bound / 8 * seconds)  # about `seconds` long whatever the share
                bps = statistics.median([await goodput(link, ids, nbytes, n, **scaled_sender(rate))
                                         for _ in range(repeats)])  # fmt: skip
                RESULTS[key("emulator", f"{rtt * 1000:g}ms", n, "conn")] = round(bps / rate, 3)
                default = " (the default)" if n == DEFAULT_CONNECTIONS else ""
                row("emulator", f"RTT {rtt * 1000:g} ms, {n} connections{default}", f"{bps / rate:.3f} of link",
                    f"windows allow {bound:.3f}; {bps / 1e6:.0f} Mbit/s")  # fmt: skip


# --- 2. pipelining ---


def record(runtime: Any, ids: list[int], mode: str, kv_bytes: int, rate: float) -> tuple[Recording, float]:
    """A prefill's layers as they were made, sped up so the state at ``rate`` takes the prefill's time."""
    _, chunk, snapshots = MODES[mode]
    recording = Recording()
    seconds = serving_prefill(runtime, ids, chunk, snapshots, recording) - recording.start
    speedup = max(1.0, rate * seconds / (8 * kv_bytes))
    recording.events = [(at / speedup, method, args) for at, method, args in recording.events]
    return recording, seconds / speedup


async def replay_into(host: str, port: int, transfers: Transfers, recording: Recording, seconds: float,
                      layers: int, kv_bytes: int, pipelined: bool, rate: float) -> float:  # fmt: skip
    """Replay a recorded prefill into a real transfer; returns the time from prefill end to the receiver's DONE."""
    config = SenderConfig(host, port, SECRET, pipelined=pipelined, done_timeout=120, **scaled_sender(rate))
    async with KVSender(config) as sender:
        await timed_send(sender, transfers, bulk_state(1 << 12, layers=1))  # connections up first
        async with sender.stream(transfers.take(), layers, kv_bytes) as out:
            prefill_end = await replay(recording, seconds, out)
        return time.perf_counter() - prefill_end


def pipelining_rows(place: str, rtt: float, mode: str, prefills: list[float], tails: list[float]) -> None:
    prefill, tail = statistics.median(prefills), statistics.median(tails)
    share = (tail - rtt) / prefill  # the transfer takes the prefill's time: (tail - RTT) / T
    ok = "" if not MODES[mode][0] else (" (goal <= 0.15: met)" if share <= 0.15 else " (goal <= 0.15: MISSED)")
    row(place, f"RTT {rtt * 1000:g} ms, {mode}", f"{tail:.3f} s",
        f"prefill end -> DONE; (that - RTT) / T = {share:.3f}{ok}; TTFT {prefill + tail:.2f} s")  # fmt: skip
    RESULTS[key(place, f"{rtt * 1000:g}ms", mode, "tail_minus_rtt_over_T")] = round(share, 3)
    RESULTS[key(place, f"{rtt * 1000:g}ms", mode, "ttft_s")] = round(prefill + tail, 3)


async def emulator_pipelining(tokens: int, rate: float, rtts: list[float], modes: list[str], repeats: int) -> None:
    from minifaas.model.runtime import ModelRuntime

    runtime = ModelRuntime.load(MODEL)
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    kv_bytes = runtime.prefill(ids).state.nbytes  # (also the warm-up)
    row("pipelining", f"{tokens} tokens, {kv_bytes / 1e6:.2f} MB, link {rate / 1e6:g} Mbit/s",
        f"T = {8 * kv_bytes / rate:.3f} s", f"{DEFAULT_CONNECTIONS} connections; T = prefill time")  # fmt: skip
    async with sink() as receiver, EmulatorProcess(("127.0.0.1", receiver.port)) as link:
        transfers = Transfers()
        for rtt in rtts:
            await link.control.set_delay(rtt * 1000 / 2)
            for mode in modes:
                prefills, tails = [], []
                for _ in range(repeats):
                    recording, seconds = await asyncio.to_thread(record, runtime, ids, mode, kv_bytes, rate)
                    await link.control.set_rate(8 * kv_bytes / seconds)  # the transfer takes as long as the prefill
                    tail = await replay_into("127.0.0.1", link.port, transfers, recording, seconds,
                                             runtime.num_layers, kv_bytes, MODES[mode][0], rate)  # fmt: skip
                    prefills.append(seconds)
                    tails.append(tail)
                pipelining_rows("pipelining", rtt, mode, prefills, tails)


# --- 3. the same through network namespaces ---


def tbf_rate(payload_bps: float) -> str:
    """The tbf rate that carries ``payload_bps`` of TCP payload. A link's measured rate (the 14.7 Gbit/s)
    is what a transfer tool moved over it, and the emulator paces payload bytes too; tbf paces frames, of
    which a full segment's 1,514 bytes carry 1,448 (Ethernet, IP and TCP headers, TCP timestamps)."""
    return f"{payload_bps * FRAME_BYTES / SEGMENT_PAYLOAD_BYTES:.0f}bit"


def _netns_env() -> dict[str, str]:
    return {**os.environ, SECRET_ENV: SECRET.decode(), "PYTHONPATH": str(Path(__file__).resolve().parent)}


def netns_goodput(
    rate: float, rtts: list[float], counts: list[int], seconds: float, repeats: int, with_ceiling: bool
) -> None:
    window = scaled_window(rate)
    cases = [(0.0, None, DEFAULT_CONNECTIONS)] if with_ceiling else []
    cases += [(rtt, window, n) for rtt in rtts for n in counts]
    for rtt, win, n in cases:
        if win is None:
            label, bound = f"tbf alone (no RTT, no window), {n} connections", 1.0
        else:
            label, bound = f"RTT {rtt * 1000:g} ms, {n} connections", window_bound(n, win, rate, rtt)
            if n == counts[0]:
                row("netns", f"{rate / 1e6:g} Mbit/s, RTT {rtt * 1000:g} ms, window {win / 1e3:.0f} KB",
                    f"{needed(rate, rtt, win)} needed", "the kernel's own TCP and its congestion control")  # fmt: skip
        nbytes = int(rate * bound / 8 * seconds)
        readings = []
        for _ in range(repeats):
            with NetnsLink(rate=tbf_rate(rate), queue_bytes=100_000, burst_bytes=32_000, rtt_ms=rtt * 1000,
                           window_bytes=win) as link:  # fmt: skip
                sizes = scaled_sender(rate)
                argv = [sys.executable, NETNS, "probe", "--bytes", str(nbytes),
                        "--connections", str(n), "--rate", f"{rate:.0f}", "--warm-up",
                        "--chunk-bytes", str(sizes["chunk_bytes"]),
                        "--unsent-bytes", str(sizes["unsent_bytes"])]  # fmt: skip
                readings.append(run_pair(link, argv, _netns_env(), timeout=60 + 4 * seconds))
        bps = statistics.median(8 * r[-1]["done"]["bytes"] / r[-1]["done"]["seconds"] for r in readings)
        rtts_seen = [h["health"]["rtt_ms"] for r in readings for h in r if "health" in h and h["health"]["rtt_ms"]]
        retrans = statistics.median(max((h["health"]["total_retrans"] for h in r if "health" in h), default=0)
                                    for r in readings)  # fmt: skip
        tag = "tbf" if win is None else f"{rtt * 1000:g}ms_{n}_conn"
        RESULTS[key("netns", tag)] = round(bps / rate, 3)
        seen = f"TCP sees RTT {statistics.median(rtts_seen):.1f} ms" if rtts_seen else "no RTT reading"
        row("netns", label, f"{bps / rate:.3f} of link",
            f"windows allow {bound:.3f}; {seen}; {retrans:.0f} segments retransmitted")  # fmt: skip


async def netns_pipelining(tokens: int, rate: float, rtts: list[float], modes: list[str], repeats: int) -> None:
    """Prefill here, replay it from namespace a (``--replay``) into a sink in b over a tbf paced to the prefill."""
    from minifaas.model.runtime import ModelRuntime

    runtime = ModelRuntime.load(MODEL)
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    kv_bytes = runtime.prefill(ids).state.nbytes
    with tempfile.TemporaryDirectory() as tmp:
        for rtt in rtts:
            for mode in modes:
                prefills, tails = [], []
                for _ in range(repeats):
                    recording, seconds = await asyncio.to_thread(record, runtime, ids, mode, kv_bytes, rate)
                    path = Path(tmp) / "recording.pt"
                    torch.save({"events": recording.events, "seconds": seconds, "layers": runtime.num_layers,
                                "kv_bytes": kv_bytes, "pipelined": MODES[mode][0], "rate": rate}, path)  # fmt: skip
                    paced = 8 * kv_bytes / seconds  # the transfer takes as long as the prefill
                    with NetnsLink(rate=tbf_rate(paced), queue_bytes=100_000, burst_bytes=32_000,
                                   rtt_ms=rtt * 1000) as link:  # fmt: skip
                        argv = [sys.executable, __file__, "--replay", str(path)]
                        (result,) = run_pair(link, argv, _netns_env(), timeout=120 + 4 * seconds)
                    prefills.append(seconds)
                    tails.append(result["tail_s"])
                pipelining_rows("netns pipe", rtt, mode, prefills, tails)


async def replay_from_file(path: str, connect: str) -> None:
    """Inside namespace a: the recorded prefill replayed into a transfer to ``connect``."""
    saved = torch.load(path, weights_only=False)
    recording = Recording()
    recording.events = saved["events"]
    host, _, port = connect.rpartition(":")
    tail = await replay_into(host, int(port), Transfers(), recording, saved["seconds"], saved["layers"],
                             saved["kv_bytes"], saved["pipelined"], saved["rate"])  # fmt: skip
    print(json.dumps({"tail_s": tail}), flush=True)


async def main(args: argparse.Namespace) -> None:
    quick = args.quick
    rtts = [0.03] if quick else [0.005, 0.03]
    counts = [1, DEFAULT_CONNECTIONS] if quick else [1, 4, 8, 16]
    modes = ["not pipelined", "worker defaults"] if quick else list(MODES)
    repeats, tokens, seconds = (1, 512, 0.5) if quick else (3, 2048, 2.0)
    rtts = [float(ms) / 1000 for ms in args.rtts.split(",")] if args.rtts else rtts
    counts = args.counts or counts
    repeats = args.repeats or repeats
    print(f"  load average {os.getloadavg()[0]:.2f} (two cores)")
    print(f"  {'section':<14} {'case':<42} {'figure':>15}  note")
    if args.only in (None, "emulator"):
        await emulator_goodput(args.emulator_rate, rtts, counts, seconds, repeats)
        if not args.goodput_only:
            await emulator_pipelining(tokens, args.pipeline_rate, rtts, modes, repeats)
    if args.only in (None, "netns"):
        if (reason := unavailable()) is not None:
            row("netns", "skipped", "", reason)
        else:
            netns_goodput(args.netns_rate, rtts, counts, seconds * 1.5, repeats, with_ceiling=not quick)
            if not args.goodput_only:
                await netns_pipelining(tokens, args.pipeline_rate, rtts, modes[-1:] if quick else modes, repeats)
    if args.json:
        print(json.dumps({"bench": "wan", **RESULTS}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one RTT (30 ms), 1 and 16 connections, short transfers")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    parser.add_argument("--only", choices=["emulator", "netns"], help="run one half")
    parser.add_argument("--emulator-rate", type=positive, default=1e9, help="bits/s of the emulated link")
    parser.add_argument("--netns-rate", type=positive, default=200e6, help="bits/s of the namespace link's tbf")
    parser.add_argument(
        "--pipeline-rate", type=positive, default=50e6, help="bits/s of the link in the pipelining runs"
    )
    parser.add_argument("--rtts", help="round trips to run, ms, comma-separated (default: 5,30; --quick: 30)")
    parser.add_argument(
        "--counts", type=positive_ints, help="connection counts of the goodput rows (default: 1,4,8,16; --quick: 1,16)"
    )
    parser.add_argument(
        "--repeats", type=positive_int, help="runs of each figure, the median shown (default: 3; --quick: 1)"
    )
    parser.add_argument("--goodput-only", action="store_true", help="the goodput rows only, no pipelining runs")
    parser.add_argument("--replay", help=argparse.SUPPRESS)  # the sender half of netns pipelining, in namespace a
    parser.add_argument("--connect", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.replay:
        asyncio.run(replay_from_file(parsed.replay, parsed.connect))
    else:
        asyncio.run(main(parsed))
