"""The scheduler live on this machine: adaptive vs fixed vs naive, under a link drop and under a shift of the mix.

The tiny model (kimi-linear-tiny) on CPU, every worker a real process, the
PrfaaS KV through the link emulator.

drop   one PrfaaS prefill worker, one PD-P and one PD-D worker, the link at
       20 Mbit/s. Two clients send ``--requests`` prompts back to back,
       alternating 120 and 240 tokens (t = 200: the long ones are offloaded);
       after ``--drop-after`` requests have finished the emulator's rate
       falls to ``--drop-bps``.
shift  one PrfaaS worker, one PD-P and two PD-D workers, the link at
       20 Mbit/s (one link to both decode workers). Three clients send decode-heavy requests
       (48-token prompts, 24 tokens out), then prefill-heavy ones (500 and
       900-token prompts, 2 tokens out; t = 600 offloads the longer half).
       The adaptive configuration also re-plans every ``--period`` seconds
       from a profile of this machine (``minifaas profile``, measured first),
       so the planner may turn a decode worker into a PD-P worker.
Configurations:
  adaptive  the scheduler on (the serve default; in shift with --profile);
  fixed     --fixed-threshold (and no re-planning): t stays put;
  naive     --fixed-threshold with t = 0: every prefill on PrfaaS.
Reported: requests done and failed, throughput, TTFT p90 (in shift: of the
prefill-heavy phase), share offloaded, link utilisation (drop: bytes the emulator
forwarded, shift: KV bytes offloaded; over the link's capacity for the run), t at the end, and in shift the
role changes and the PD split at the end (+n: n workers still changing role). Every PD worker shares this
machine's two cores, so a new split cannot add compute here: the shift
scenario shows the conversion working under load, not its gain (the
simulator at paper scale shows that: bench_scheduler.py).

    python benchmarks/bench_scheduler_live.py [--scenario drop|shift|both] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from minifaas import figures
from minifaas.commands.arguments import count, positive, positive_int
from minifaas.config import CacheConfig, ClusterConfig, InterClusterLinkConfig, SchedulerConfig, ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, RequestFailed, RequestRecord
from minifaas.launch import forked
from minifaas.model.sampling import SamplingParams

FULL_BPS = 20e6
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


async def one_run(config: ServeConfig, n: int, drop_after: int, drop_bps: float) -> dict[str, float]:
    async with Gateway(config) as gw:
        queue = list(range(n))
        records: list[RequestRecord] = []
        failed = 0
        dropped_at: float | None = None
        started = time.monotonic()

        async def client() -> None:
            nonlocal failed, dropped_at
            while queue:
                i = queue.pop(0)
                prompt = [(i * 37 + 11 * k) % 256 for k in range(240 if i % 2 else 120)]
                record = RequestRecord(f"r{i}", len(prompt))
                try:
                    async for _ in gw.stream(GenerateRequest(f"r{i}", prompt, PARAMS), record):
                        pass
                    records.append(record)
                except RequestFailed:
                    failed += 1
                if dropped_at is None and len(records) + failed >= drop_after:
                    dropped_at = time.monotonic()
                    await gw.link.control.set_rate(drop_bps)

        await asyncio.gather(client(), client())
        ended = time.monotonic()
        stats = await gw.link.control.stats()
        drop = dropped_at if dropped_at is not None else ended
        capacity_bytes = (FULL_BPS * (drop - started) + drop_bps * (ended - drop)) / 8
        ttft = np.array([r.ttft_s for r in records if r.ttft_s is not None])
        return {
            "done": len(records),
            "failed": failed,
            "tput": len(records) / (ended - started),
            "ttft_p90": float(np.percentile(ttft, 90)) if ttft.size else float("nan"),
            "offloaded": sum(r.route == "prfaas" for r in records) / max(1, len(records)),
            "link_util": stats["up_bytes"] / capacity_bytes,
            "t_end": gw.scheduler.threshold,
            "wall": ended - started,
        }


SHORT = SamplingParams(max_tokens=24, ignore_eos=True)
LONG = SamplingParams(max_tokens=2, ignore_eos=True)


async def shift_run(config: ServeConfig, n_short: int, n_long: int) -> dict[str, float]:
    """Decode-heavy requests, then prefill-heavy ones, from three clients."""
    async with Gateway(config) as gw:
        queue = list(range(n_short + n_long))
        records: list[RequestRecord] = []
        failed = 0
        started = time.monotonic()

        async def client() -> None:
            nonlocal failed
            while queue:
                i = queue.pop(0)
                heavy = i >= n_short
                n = (900 if i % 2 else 500) if heavy else 48
                prompt = [(i * 37 + 11 * k) % 256 for k in range(n)]
                record = RequestRecord(f"{'long' if heavy else 'short'}{i}", len(prompt))
                try:
                    async for _ in gw.stream(
                        GenerateRequest(record.request_id, prompt, LONG if heavy else SHORT), record
                    ):
                        pass
                    records.append(record)
                except RequestFailed:
                    failed += 1

        await asyncio.gather(client(), client(), client())
        ended = time.monotonic()
        heavy = np.array([r.ttft_s for r in records if r.request_id.startswith("long") and r.ttft_s is not None])
        split = [w.role for w in gw.pool.workers.values() if w.cluster == "pd"]
        return {
            "done": len(records),
            "failed": failed,
            "tput": len(records) / (ended - started),
            "ttft_p90": float(np.percentile(heavy, 90)) if heavy.size else 0.0,
            "offloaded": sum(r.route == "prfaas" for r in records) / max(1, len(records)),
            "link_util": sum(r.kv_bytes for r in records if r.route == "prfaas") / (FULL_BPS * (ended - started) / 8),
            "t_end": gw.scheduler.threshold,
            "role_changes": len(gw.roles.done),
            "changes": ", ".join(
                f"{c.old}->{c.role} (drain {c.drain_s:.1f} s, start {c.start_s:.1f} s)" for c in gw.roles.done
            ),
            "split": f"{split.count('prefill')}P/{split.count('decode')}D"
            + (f"+{len(gw.roles.tasks)}" if gw.roles.tasks else ""),  # +n: n workers changing role
            "wall": ended - started,
        }


def measure_profile(path: Path, quick: bool) -> None:
    """The instance profile the adaptive configuration re-plans with: ``minifaas profile`` on this machine."""
    lengths, batches = ("32,128", "1,2") if quick else ("64,256,1024", "1,2,4,8")
    cmd = [sys.executable, "-m", "minifaas.commands.main", "profile", "--lengths", lengths, "--batches", batches]
    cmd += ["--slo", "1", "--repeats", "1" if quick else "3", "--out", str(path)]  # slo: any CPU meets it
    subprocess.run(cmd, check=True, capture_output=True)


def drop_scenario(args: argparse.Namespace, out: dict) -> None:
    base = ServeConfig(
        model="kimi-linear-tiny",
        threshold=200,
        link=InterClusterLinkConfig(rate="20mbit", delay_ms=2.0),
        cache=CacheConfig(mode="none"),
    )
    configs = {
        "adaptive": base,
        "fixed": replace(base, fixed_threshold=True),
        "naive": replace(base, fixed_threshold=True, threshold=0),
    }
    print(f"drop: kimi-linear-tiny on CPU, {args.requests} requests, link 20 Mbit/s -> {args.drop_bps / 1e6:g} Mbit/s")
    print(f"{'config':<10}{'done':>6}{'failed':>8}{'req/s':>8}{'ttft p90 s':>12}{'offloaded':>11}{'link util':>11}"
          f"{'t end':>7}{'wall s':>8}")  # fmt: skip
    for name, config in _chosen(configs, args.quick):
        r = asyncio.run(one_run(config, args.requests, args.drop_after, args.drop_bps))
        print(f"{name:<10}{r['done']:>6}{r['failed']:>8}{r['tput']:>8.3f}{r['ttft_p90']:>12.2f}{r['offloaded']:>11.2f}"
              f"{r['link_util']:>11.3f}{r['t_end']:>7}{r['wall']:>8.1f}")  # fmt: skip
        out[f"drop_{name}"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}


def shift_scenario(args: argparse.Namespace, out: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.json"
        measure_profile(profile, args.quick)
        base = ServeConfig(
            model="kimi-linear-tiny",
            threshold=600,
            pd=ClusterConfig(prefill_workers=1, decode_workers=2),
            link=InterClusterLinkConfig(rate="20mbit", delay_ms=2.0),
            cache=CacheConfig(mode="none"),
        )
        replan = SchedulerConfig(profile=str(profile), period_s=args.period, min_requests=8, drain_timeout=60.0)
        configs = {
            "adaptive": replace(base, scheduler=replan),
            "fixed": replace(base, fixed_threshold=True),
            "naive": replace(base, fixed_threshold=True, threshold=0),
        }
        print(f"shift: kimi-linear-tiny on CPU, {args.short} decode-heavy then {args.long} prefill-heavy requests, "
              f"re-plan every {args.period:g} s")  # fmt: skip
        print(f"{'config':<10}{'done':>6}{'failed':>8}{'req/s':>8}{'ttft p90 s':>12}{'offloaded':>11}{'link util':>11}"
              f"{'t end':>7}{'roles':>7}{'split':>9}{'wall s':>8}")  # fmt: skip
        for name, config in _chosen(configs, args.quick):
            r = asyncio.run(shift_run(config, args.short, args.long))
            print(f"{name:<10}{r['done']:>6}{r['failed']:>8}{r['tput']:>8.3f}{r['ttft_p90']:>12.2f}"
                  f"{r['offloaded']:>11.2f}{r['link_util']:>11.3f}{r['t_end']:>7}{r['role_changes']:>7}"
                  f"{r['split']:>9}{r['wall']:>8.1f}")  # fmt: skip
            if r["changes"]:
                print(f"{'':<10}role changes: {r['changes']}")
            out[f"shift_{name}"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}


def _chosen(configs: dict[str, ServeConfig], quick: bool) -> list[tuple[str, ServeConfig]]:
    """A smoke run exercises the adaptive configuration only."""
    return [("adaptive", configs["adaptive"])] if quick else list(configs.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("drop", "shift", "both"), default="both")
    parser.add_argument("--requests", type=positive_int, default=24, help="drop: requests per configuration")
    parser.add_argument("--drop-after", type=count, default=6, help="drop: finished requests before the drop")
    parser.add_argument("--drop-bps", type=positive, default=400e3, help="drop: the link's rate after the drop")
    parser.add_argument("--short", type=count, default=12, help="shift: decode-heavy requests first")
    parser.add_argument("--long", type=count, default=48, help="shift: prefill-heavy requests after them")
    parser.add_argument("--period", type=positive, default=8.0, help="shift: seconds between re-plans (adaptive)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer requests, adaptive only")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.drop_after, args.short, args.long, args.period = 6, 2, 3, 9, 3.0
    forked.start_here("kimi-linear-tiny")  # the workers' parent, forked from here before any torch op
    out: dict[str, dict] = {}
    if args.scenario in ("drop", "both"):
        drop_scenario(args, out)
    if args.scenario in ("shift", "both"):
        shift_scenario(args, out)
    if args.json:
        print(figures.dumps(out))


if __name__ == "__main__":
    main()
