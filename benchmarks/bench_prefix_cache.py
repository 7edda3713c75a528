"""Prefix caching in the running system: multi-turn conversations from the Mooncake trace, cache on and off.

Conversations: trace requests grouped by their first hash id (a shared first
block means a shared document or history), the first groups with at least
``--min-turns`` requests, replayed in trace order, one request at a time, until
``--requests`` are taken. Each hash id becomes a fixed pseudo-random block of
token ids (same id, same tokens), and every length is divided by ``--scale``
(512-token trace blocks become 512/scale tokens), so a CPU run finishes.
Outputs are the trace's lengths scaled the same way, between 1 and 8 tokens.

The same requests run against a fresh gateway three times, side by side: with
the hybrid prefix cache ("cache"), with it but every PrfaaS state sent whole
(``--no-incremental-transfer``, "cache, full"), and with ``--prefix-cache none``.
Reported: TTFT p50/p90, prompt tokens actually prefilled, the usable hit ratio
the cache achieved beside the trace's ideal one at the same scale (an unbounded
cache where any shared full block counts, with no need for a state snapshot),
and the state bytes that crossed the inter-cluster link (PrfaaS states to the
decode node, and caches moved before prefill under ``--rule abundant``). The
scheduler is held fixed (threshold and rule do not move), so the runs differ in
the cache alone.

    python benchmarks/bench_prefix_cache.py [--requests 36] [--scale 32] [--snapshot-policy reuse] [--json] [--quick]

``--quick`` is the smoke run the tests make: 6 requests, lengths / 128
unless given; the same three gateways.

Trace: Mooncake (FAST'25) synthetic workload, Apache-2.0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from minifaas import figures
from minifaas.commands.arguments import count, positive_int
from minifaas.config import SNAPSHOT_POLICIES, CacheConfig, ClusterConfig, InterClusterLinkConfig, ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.launch import forked
from minifaas.model.sampling import SamplingParams
from minifaas.traces import MOONCAKE_BLOCK_TOKENS, trace_path


@dataclass(frozen=True, slots=True)
class Turn:
    hash_ids: tuple[int, ...]
    tokens: list[int]
    max_tokens: int


def conversations(path: Path, scale: int, requests: int, min_turns: int, vocab: int = 256) -> list[Turn]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[row["hash_ids"][0]].append(i)
    chosen: list[int] = []
    for members in sorted(groups.values(), key=lambda m: m[0]):
        if len(members) >= min_turns and len(chosen) < requests:
            chosen += members[: requests - len(chosen)]
    block = MOONCAKE_BLOCK_TOKENS // scale
    turns = []
    for i in sorted(chosen):
        row = rows[i]
        n = max(1, row["input_length"] // scale)
        ids = tuple(row["hash_ids"])
        tokens = [t for h in ids for t in random.Random(h).choices(range(vocab), k=block)][:n]
        turns.append(Turn(ids, tokens, min(8, max(1, row["output_length"] // scale))))
    return turns


def ideal_hits(turns: list[Turn], block: int) -> list[int]:
    """Per turn, the hit of an unbounded cache where any shared full block counts (one token is always computed)."""
    seen: set[tuple[int, ...]] = set()
    hits = []
    for turn in turns:
        full = len(turn.tokens) // block
        shared = next((j for j in range(full) if turn.hash_ids[: j + 1] not in seen), full)
        hits.append(min(shared * block, len(turn.tokens) - 1))
        seen.update(turn.hash_ids[: j + 1] for j in range(full))
    return hits


async def replay(config: ServeConfig, turns: list[Turn]) -> tuple[list[RequestRecord], int]:
    """Every turn, one at a time; the records and the bytes of cache moves across the link."""
    records = []
    async with Gateway(config) as gw:
        for i, turn in enumerate(turns):
            record = RequestRecord(f"r{i}", len(turn.tokens))
            request = GenerateRequest(record.request_id, turn.tokens, SamplingParams(turn.max_tokens, ignore_eos=True))
            async for _ in gw.stream(request, record):
                pass
            records.append(record)
        return records, gw.dispatch.moves.counts["bytes"]


def summarise(records: list[RequestRecord], moved_bytes: int, repeats: list[bool], seconds: float) -> dict:
    ttft = sorted(r.ttft_s or 0.0 for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    return {
        "requests": len(records),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "ttft_p50_repeat_s": statistics.median(r.ttft_s or 0.0 for r, rep in zip(records, repeats) if rep),
        "ttft_p50_first_s": statistics.median(r.ttft_s or 0.0 for r, rep in zip(records, repeats) if not rep),
        "prompt_tokens": prompt,
        "prefill_tokens": prompt - cached,
        "hit_ratio": cached / prompt,
        "prfaas_requests": sum(r.route == "prfaas" for r in records),
        "link_bytes": sum(r.kv_bytes for r in records if r.route == "prfaas") + moved_bytes,
        "moved_bytes": moved_bytes,
        "wall_s": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default="mooncake-synthetic", help="a shipped trace or a Mooncake .jsonl file")
    p.add_argument("--requests", type=positive_int, default=36)
    p.add_argument("--scale", type=positive_int, default=32, help="divide every trace length by this")
    p.add_argument("--min-turns", type=positive_int, default=3)
    p.add_argument("--threshold", type=count, default=256, help="incremental tokens above this go PrfaaS")
    p.add_argument("--snapshot-policy", choices=SNAPSHOT_POLICIES, default=CacheConfig().snapshot_policy,
                   help="where state snapshots go (cache.snapshot_policy)")  # fmt: skip
    p.add_argument("--snapshot-interval", type=count, default=4, help="the interval policy's blocks between snapshots")
    p.add_argument("--rule", choices=("scarce", "abundant"), default="scarce", help="routing rule, held fixed")
    p.add_argument("--model", default="kimi-linear-tiny")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every figure")
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer requests, the same code path")
    args = p.parse_args()
    if args.quick:  # flags given on the command line still win
        p.set_defaults(requests=6, scale=128)
        args = p.parse_args()
    forked.start_here(args.model)  # the workers' parent, forked from here before any torch op

    trace = trace_path(args.trace)
    turns = conversations(trace, args.scale, args.requests, args.min_turns)
    block = MOONCAKE_BLOCK_TOKENS // args.scale
    ideal = ideal_hits(turns, block)
    repeats = [hit > 0 for hit in ideal]  # a turn that shares a prefix with an earlier one
    base = ServeConfig(
        model=args.model,
        threshold=args.threshold,
        fixed_threshold=True,  # the scheduler holds t and the rule: this measures the cache, not the scheduler
        prfaas=ClusterConfig(prefill_workers=1),
        pd=ClusterConfig(prefill_workers=1, decode_workers=1),
        link=InterClusterLinkConfig(rate="100mbit", delay_ms=5.0),
        cache=CacheConfig(
            block_size=block,
            snapshot_policy=args.snapshot_policy,
            snapshot_interval_blocks=args.snapshot_interval,
            rule=args.rule,
        ),
    )
    runs = {
        "cache": base.cache,
        "cache_full": replace(base.cache, incremental_transfer=False),
        "none": replace(base.cache, mode="none"),
    }
    results = {}
    for name, cache in runs.items():
        start = time.perf_counter()
        records, moved = asyncio.run(replay(replace(base, cache=cache), turns))
        results[name] = summarise(records, moved, repeats, time.perf_counter() - start)
    ideal_ratio = sum(ideal) / results["none"]["prompt_tokens"]

    print(f"{len(turns)} requests from {trace.name}, lengths / {args.scale} ({block}-token blocks), {args.model}")
    interval = args.snapshot_policy == "interval"
    where = f"every {args.snapshot_interval} blocks" if interval else "at ends and branch points"
    print(f"threshold {args.threshold} and the {args.rule} rule held fixed, snapshots {where}, one request at a time")
    print(f"{'':24}{'cache':>14}{'cache, full':>14}{'none':>14}")
    rows = [
        ("TTFT p50 (s)", "ttft_p50_s", "{:.3f}"),
        ("TTFT p90 (s)", "ttft_p90_s", "{:.3f}"),
        (f"TTFT p50, {sum(repeats)} repeats", "ttft_p50_repeat_s", "{:.3f}"),
        (f"TTFT p50, {len(turns) - sum(repeats)} first turns", "ttft_p50_first_s", "{:.3f}"),
        ("prompt tokens", "prompt_tokens", "{:,}"),
        ("prefill tokens", "prefill_tokens", "{:,}"),
        ("usable hit ratio", "hit_ratio", "{:.3f}"),
        ("PrfaaS requests", "prfaas_requests", "{}"),
        ("link bytes", "link_bytes", "{:,}"),
        ("  of them cache moves", "moved_bytes", "{:,}"),
        ("wall (s)", "wall_s", "{:.1f}"),
    ]
    for label, key, fmt in rows:
        print(f"{label:24}" + "".join(f"{fmt.format(results[name][key]):>14}" for name in runs))
    print(f"{'ideal hit ratio':24}{ideal_ratio:>14.3f}")
    if args.json:
        print(figures.dumps({"bench": "prefix_cache", "scale": args.scale, "ideal_hit_ratio": ideal_ratio, **results}))


if __name__ == "__main__":
    main()
