"""Forwards with freed host memory kept (``minifaas.model.host_memory``) against the C library's defaults.

    python benchmarks/bench_host_memory.py [--model kimi-linear-tiny] [--rounds 3] [--threads 1] [--json] [--quick]

Each round starts two fresh processes one after the other, one as every
``ModelRuntime`` now runs and one with ``MINIFAAS_HOST_MALLOC=system`` (glibc's
own thresholds), the order turning each round; each loads the model and
measures, in a thread as a worker does, the median time of a 128-token and a
2,048-token prefill, of a decode step, and the page faults per 128-token
prefill. Fresh processes per round, since one process's speed can differ from
the next one's on a shared host. ``--quick`` is the smoke run the tests make:
one round, 512 tokens for the long prompt, fewer repeats; the same code path.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from minifaas.commands.arguments import positive_int

VARIANTS = {"kept": {}, "system": {"MINIFAAS_HOST_MALLOC": "system"}}


def child(model: str, short: int, long: int, repeats: int, threads: int) -> dict:
    """In a fresh process: load, warm up, then time the forwards in a thread."""
    import torch

    from minifaas.model.interleaved_decoder import DecodeStream, generate
    from minifaas.model.runtime import ModelRuntime
    from minifaas.model.sampling import SamplingParams

    torch.set_num_threads(threads)
    rt = ModelRuntime.load(model)

    def prompt(n: int, salt: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n + salt)).tolist()

    def run() -> dict:
        generate(rt, [1, 2, 3], SamplingParams(max_tokens=2))
        for salt in range(3):
            rt.prefill(prompt(short, 1000 + salt))
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        shorts = [rt.prefill(prompt(short, salt)).seconds for salt in range(repeats)]
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / repeats
        longs = [rt.prefill(prompt(long, salt)).seconds for salt in range(max(1, repeats // 5))]
        result = rt.prefill(prompt(short, -1))
        steps = SamplingParams(max_tokens=repeats + 1, ignore_eos=True)
        stream = DecodeStream(rt, result.state, result.next_token, steps)
        start = time.perf_counter()
        stream.run()
        step = (time.perf_counter() - start) / repeats
        return {"short_s": statistics.median(shorts), "long_s": statistics.median(longs), "step_s": step,
                "faults": faults}  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kimi-linear-tiny")
    p.add_argument("--rounds", type=positive_int, default=3, help="pairs of fresh processes")
    p.add_argument("--repeats", type=positive_int, default=15, help="128-token prefills and decode steps per process")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads in each process")
    p.add_argument("--long", type=positive_int, default=2048, help="the long prompt's tokens")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    p.add_argument("--quick", action="store_true", help="a smoke run: one round, shorter, the same code path")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:  # flags given on the command line still win
        p.set_defaults(rounds=1, repeats=5, long=512)
        a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.model, 128, a.long, a.repeats, a.threads)), flush=True)
        return
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    argv = [sys.executable, __file__, "--child", "--model", a.model, "--repeats", str(a.repeats),
            "--threads", str(a.threads), "--long", str(a.long)]  # fmt: skip
    for r in range(a.rounds):
        for name in list(VARIANTS)[:: 1 if r % 2 == 0 else -1]:
            env = {k: v for k, v in os.environ.items() if k != "MINIFAAS_HOST_MALLOC"} | VARIANTS[name]
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=True)
            runs[name].append(json.loads(done.stdout.splitlines()[-1]))
            print(f"  round {r + 1}/{a.rounds}, {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    med = {name: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for name, xs in runs.items()}
    print(f"{a.model}, {a.threads} torch thread(s), medians over {a.rounds} round(s) of fresh processes")
    print(f"{'':28}{'kept':>10}{'system':>10}{'kept/system':>13}")
    rows = (("128-token prefill (ms)", "short_s", 1e3), (f"{a.long}-token prefill (ms)", "long_s", 1e3),
            ("decode step (ms)", "step_s", 1e3), ("page faults per prefill", "faults", 1))  # fmt: skip
    for label, key, scale in rows:
        kept, system = med["kept"][key] * scale, med["system"][key] * scale
        ratio = f"{kept / system:.2f}" if system else "-"
        print(f"{label:28}{kept:>10.1f}{system:>10.1f}{ratio:>13}")
    if a.json:
        print(json.dumps({"bench": "host_memory", "model": a.model, "long": a.long, **med}))


if __name__ == "__main__":
    main()
