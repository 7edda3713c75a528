"""A recorded trace replayed at its timestamps against three servers side by side: prefix cache with the
``reuse`` snapshot policy, with the earlier ``interval`` policy, and ``--prefix-cache none``.

    python benchmarks/bench_trace_replay.py [--traces mooncake-synthetic,azure-conv,azure-code] [--requests 60]
        [--scale 32,2,2] [--json] [--quick]

The three gateways run at once, each with its own PrfaaS prefill, PD-P and PD-D
workers and link emulator. Request k is sent at its trace timestamp (times
``--time-scale``), or as soon as request k-1 is done if that is later, to the
three servers one after another in an order that rotates with k, so each
configuration sees the same load, and none sees another's queue. Lengths are
divided by the trace's ``--scale``; a Mooncake hash id becomes a fixed
pseudo-random block of 512/scale token ids (same id, same tokens, so prefixes
are shared as in the trace), and an Azure request, which has no prefix
information, gets tokens no other request shares. Outputs are 1-4 tokens: TTFT
is what is measured. The cache's blocks are ``--block-tokens`` (16: a Mooncake
block at the default scale); the traces run one after another through the same
three servers.

Reported per trace: TTFT p50 and p90 of each server and their ratios to cache
off; by prompt length (up to 256, 257-1,024, above 1,024 tokens) the count and
the median over requests of each request's TTFT ratio to cache off; the usable
hit ratio; and how many requests were sent late (the three servers take longer
than the gap to the next arrival). ``--quick`` is the smoke run the tests make:
3 requests of each trace at larger scales; the same code path.

Traces: Mooncake (FAST'25) synthetic workload, Apache-2.0; Azure LLM inference
traces 2023, CC-BY-4.0 (data/traces).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from dataclasses import dataclass, replace

from minifaas import figures
from minifaas.commands.arguments import count, positive, positive_int
from minifaas.config import CacheConfig, ClusterConfig, InterClusterLinkConfig, ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.launch import forked
from minifaas.model.sampling import SamplingParams
from minifaas.traces import MOONCAKE_BLOCK_TOKENS, read_trace

SERVERS = ("reuse", "interval", "none")
BUCKETS = ((1, 256), (257, 1024), (1025, 10**9))
PARTS = ("queue_s", "prefill_s", "store_s", "transfer_s", "control_s")  # where TTFT went (RequestRecord)


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    tokens: list[int]
    max_tokens: int


def arrivals(name: str, scale: int, requests: int, vocab: int = 256) -> list[Arrival]:
    """The trace's first ``requests`` requests, lengths / ``scale``, as token ids."""
    block = max(1, MOONCAKE_BLOCK_TOKENS // scale)  # the tokens one hash id stands for
    trace = read_trace(name, length_scale=1.0 / scale)
    out = []
    for k in range(min(requests, len(trace.input_tokens))):
        n = max(2, int(trace.input_tokens[k]))
        if trace.hash_ids is not None:  # a hash id stands for one block of the scaled prompt
            ids = trace.hash_ids[k]
            tokens = [t for h in ids for t in random.Random(h).choices(range(vocab), k=block)][:n]
            tokens += random.Random(-k - 1).choices(range(vocab), k=n - len(tokens))  # past the last hash id
        else:
            tokens = random.Random(f"{name}/{k}").choices(range(vocab), k=n)
        out.append(Arrival(float(trace.arrival_s[k]), tokens, min(4, max(1, int(trace.output_tokens[k])))))
    return out


async def one(gw: Gateway, rid: str, arrival: Arrival) -> RequestRecord:
    record = RequestRecord(rid, len(arrival.tokens))
    request = GenerateRequest(rid, arrival.tokens, SamplingParams(arrival.max_tokens, ignore_eos=True))
    async for _ in gw.stream(request, record):
        pass
    return record


async def replay(
    configs: dict[str, ServeConfig], traces: dict[str, list[Arrival]], time_scale: float
) -> dict[str, tuple[dict[str, list[RequestRecord]], int]]:
    """Each trace in turn through the same three servers; per trace, the records per server and the late sends."""
    out = {}
    async with contextlib.AsyncExitStack() as stack:
        gateways = {name: await stack.enter_async_context(Gateway(c)) for name, c in configs.items()}
        for trace_name, trace in traces.items():
            out[trace_name] = await replay_one(gateways, trace_name, trace, time_scale)
    return out


async def replay_one(
    gateways: dict[str, Gateway], trace_name: str, trace: list[Arrival], time_scale: float
) -> tuple[dict[str, list[RequestRecord]], int]:
    """Request k to every server in turn (the order rotates with k), at its timestamp or when k-1 is done."""
    records: dict[str, list[RequestRecord]] = {name: [] for name in gateways}
    names, late = list(gateways), 0
    start = time.perf_counter()
    for k, arrival in enumerate(trace):
        wait = start + arrival.at_s * time_scale - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)  # the trace's own gap until this arrival
        else:
            late += k > 0
        for name in names[k % len(names) :] + names[: k % len(names)]:
            records[name].append(await one(gateways[name], f"{trace_name}-{name}-{k}", arrival))
    return records, late


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def summarise(records: dict[str, list[RequestRecord]], late: int) -> dict:
    ttft = {name: [r.ttft_s or 0.0 for r in rs] for name, rs in records.items()}
    off = ttft["none"]
    out: dict = {"requests": len(off), "late": late, "servers": {}, "buckets": []}
    for name, xs in ttft.items():
        rs = records[name]
        out["servers"][name] = {
            "ttft_p50_s": statistics.median(xs),
            "ttft_p90_s": p90(xs),
            "p50_over_none": statistics.median(xs) / statistics.median(off),
            "p90_over_none": p90(xs) / p90(off),
            "hit_ratio": sum(r.cached_tokens for r in rs) / sum(r.prompt_tokens for r in rs),
        } | {f"{part}_p50_s": statistics.median(getattr(r, part) or 0.0 for r in rs) for part in PARTS}
    lengths = [r.prompt_tokens for r in records["none"]]
    for lo, hi in BUCKETS:
        ks = [k for k, n in enumerate(lengths) if lo <= n <= hi]
        row: dict = {"bucket": f"{lo}-{hi}" if hi < 10**9 else f">{lo - 1}", "requests": len(ks)}
        for name in ("reuse", "interval"):
            row[f"{name}_over_none"] = statistics.median(ttft[name][k] / off[k] for k in ks) if ks else None
        out["buckets"].append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default="mooncake-synthetic,azure-conv,azure-code", help="shipped traces or files")
    p.add_argument("--requests", type=positive_int, default=60, help="the first this many of each trace")
    p.add_argument("--scale", default="32,2,2", help="divide each trace's lengths by this (one per trace)")
    p.add_argument("--block-tokens", type=positive_int, default=16, help="the cache's block (a Mooncake block over 32)")
    p.add_argument("--time-scale", type=positive, default=1.0, help="multiply the trace's timestamps by this")
    p.add_argument("--threshold", type=count, default=512, help="incremental tokens above this go PrfaaS (held)")
    spacing = "the interval server's blocks between snapshots (8 x 16: the serving default's 128 tokens)"
    p.add_argument("--snapshot-interval", type=count, default=8, help=spacing)
    p.add_argument("--model", default="kimi-linear-tiny")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every figure")
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer, shorter requests, the same code path")
    args = p.parse_args()
    if args.quick:  # flags given on the command line still win
        p.set_defaults(requests=3, scale="128,8,8", time_scale=0.0)
        args = p.parse_args()
    forked.start_here(args.model)  # the workers' parent, forked from here before any torch op
    names, scales = args.traces.split(","), [int(s) for s in args.scale.split(",")]
    if len(scales) != len(names):
        p.error(f"--scale needs one value per trace: {len(names)} traces, {len(scales)} scales")
    block = args.block_tokens
    base = ServeConfig(
        model=args.model,
        threshold=args.threshold,
        fixed_threshold=True,  # the scheduler holds t and the rule: the runs differ in the cache alone
        prfaas=ClusterConfig(prefill_workers=1),
        pd=ClusterConfig(prefill_workers=1, decode_workers=1),
        link=InterClusterLinkConfig(rate="100mbit", delay_ms=5.0),
        cache=CacheConfig(block_size=block, snapshot_interval_blocks=args.snapshot_interval),
    )
    configs = {
        "reuse": replace(base, cache=replace(base.cache, snapshot_policy="reuse")),
        "interval": replace(base, cache=replace(base.cache, snapshot_policy="interval")),
        "none": replace(base, cache=replace(base.cache, mode="none")),
    }
    traces = {name: arrivals(name, scale, args.requests) for name, scale in zip(names, scales, strict=True)}
    replayed = asyncio.run(replay(configs, traces, args.time_scale))
    results = {}
    for (name, (records, late)), scale in zip(replayed.items(), scales, strict=True):
        results[name] = res = summarise(records, late) | {"scale": scale, "block_tokens": block}
        head = f"{res['requests']} requests, lengths / {scale} ({block}-token blocks), {res['late']} sent late"
        print(f"\n{name}: {head}")
        print(f"{'':22}" + "".join(f"{s:>12}" for s in SERVERS))
        for label, key, fmt in (
            ("TTFT p50 (s)", "ttft_p50_s", "{:.3f}"),
            ("TTFT p90 (s)", "ttft_p90_s", "{:.3f}"),
            ("p50 over cache off", "p50_over_none", "{:.2f}"),
            ("p90 over cache off", "p90_over_none", "{:.2f}"),
            ("usable hit ratio", "hit_ratio", "{:.3f}"),
            *((f"  {part.removesuffix('_s')} p50 (s)", f"{part}_p50_s", "{:.4f}") for part in PARTS),
        ):
            print(f"{label:22}" + "".join(f"{fmt.format(res['servers'][s][key]):>12}" for s in SERVERS))
        print(f"{'median TTFT ratio to cache off, by prompt tokens':52}{'reuse':>10}{'interval':>10}")
        for row in res["buckets"]:
            ratios = (row["reuse_over_none"], row["interval_over_none"])
            cells = "".join(f"{'-' if r is None else format(r, '.2f'):>10}" for r in ratios)
            print(f"  {row['bucket']:>12} tokens, {row['requests']:>3} requests{'':18}{cells}")
    if args.json:
        print(figures.dumps({"bench": "trace_replay", "traces": results}))


if __name__ == "__main__":
    main()
