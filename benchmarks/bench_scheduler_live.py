"""The scheduler live on this machine: adaptive vs fixed threshold vs naive offloading, the link dropping mid-run.

The tiny model (kimi-linear-tiny) on CPU: one PrfaaS prefill worker, one PD-P
and one PD-D worker, the PrfaaS KV through the link emulator at 20 Mbit/s.
Two clients send ``--requests`` prompts back to back, alternating 120 and 240
tokens (t = 200: the long ones are offloaded); after ``--drop-after`` requests
have finished the emulator's rate falls to ``--drop-bps``. Configurations:
  adaptive  the short-term scheduler on (the serve default);
  fixed     --fixed-threshold: t stays 200;
  naive     --fixed-threshold with t = 0: every prefill on PrfaaS.
Reported: requests done and failed, throughput, TTFT p90, share offloaded,
link utilisation (bytes the emulator forwarded / its capacity over the run).

    python benchmarks/bench_scheduler_live.py
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace

import numpy as np

from minifaas.model.sampling import SamplingParams
from minifaas.serve.config import CacheConfig, LinkConfig, ServeConfig
from minifaas.serve.gateway import Gateway
from minifaas.serve.requests import GenerateRequest, RequestFailed, RequestRecord

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
                    await gw.emulators["pd-d0"].control.set_rate(drop_bps)

        await asyncio.gather(client(), client())
        ended = time.monotonic()
        stats = await gw.emulators["pd-d0"].control.stats()
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
            "t_end": gw.threshold,
            "wall": ended - started,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--drop-after", type=int, default=6)
    parser.add_argument("--drop-bps", type=float, default=400e3)
    args = parser.parse_args()
    base = ServeConfig(threshold=200, link=LinkConfig(rate="20mbit", delay_ms=2.0), cache=CacheConfig(mode="none"))
    configs = {
        "adaptive": base,
        "fixed": replace(base, fixed_threshold=True),
        "naive": replace(base, fixed_threshold=True, threshold=0),
    }
    print(f"kimi-linear-tiny on CPU, {args.requests} requests, link 20 Mbit/s -> {args.drop_bps / 1e6:g} Mbit/s")
    print(f"{'config':<10}{'done':>6}{'failed':>8}{'req/s':>8}{'ttft p90 s':>12}{'offloaded':>11}{'link util':>11}"
          f"{'t end':>7}{'wall s':>8}")  # fmt: skip
    for name, config in configs.items():
        r = asyncio.run(one_run(config, args.requests, args.drop_after, args.drop_bps))
        print(f"{name:<10}{r['done']:>6}{r['failed']:>8}{r['tput']:>8.3f}{r['ttft_p90']:>12.2f}{r['offloaded']:>11.2f}"
              f"{r['link_util']:>11.3f}{r['t_end']:>7}{r['wall']:>8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
