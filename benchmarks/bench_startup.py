"""Gateway start-up: local workers forked from a pre-loaded parent against fresh interpreters, side by side.

Each round starts the default serving configuration (three local CPU workers
and the link emulator) once with ``fork_workers`` on and once off, in
alternating order, and times it from ``Gateway.__aenter__`` to every worker
ready, then one request through each route to show the workers serve (its
tokens must equal transformers' own generate()'s, ``model.reference``), then
the shutdown. Every start is a cold one, as ``minifaas serve`` has: the
process's shared pre-loaded parent is closed with the gateway, and its CPU
counted. Reported: the median over
``--rounds`` of each phase, the CPU seconds the whole process tree used, and
the ratios. ``--quick``: one round.

    python benchmarks/bench_startup.py [--rounds 3] [--model NAME] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from minifaas import figures
from minifaas.commands.arguments import positive_int
from minifaas.config import ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.launch import forked
from minifaas.model.loader import DEFAULT_MODEL
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = {"local": 64, "prfaas": 700}  # tokens; the threshold below sends the long one to PrfaaS
THRESHOLD = 512


def prompt(n: int) -> list[int]:
    return [i % 251 for i in range(n)]  # bytes: every model here has the byte vocabulary


def children_cpu_s() -> float:
    """CPU seconds of every reaped descendant so far (workers count once they have exited)."""
    t = os.times()
    return t.children_user + t.children_system


async def one_start(model: str, fork: bool, expected: dict[str, list[int]]) -> dict[str, float]:
    config = ServeConfig(model=model, threshold=THRESHOLD, fork_workers=fork)
    cpu0, t0 = children_cpu_s() + time.process_time(), time.perf_counter()
    async with Gateway(config) as gateway:
        ready = time.perf_counter()
        for route, n in PROMPTS.items():
            record = RequestRecord(f"{route}-{fork}", n)
            request = GenerateRequest(record.request_id, prompt(n), GREEDY)
            tokens = [event.token_id async for event in gateway.stream(request, record)]
            if record.route != route or tokens != expected[route]:
                raise AssertionError(f"{route}: route {record.route}, tokens {tokens} != {expected[route]}")
        served = time.perf_counter()
    forked.close_shared()  # the next round starts its own, as another process would
    done = time.perf_counter()
    cpu = children_cpu_s() + time.process_time() - cpu0
    return {"ready_s": ready - t0, "requests_s": served - ready, "stop_s": done - served, "cpu_s": cpu}


async def run(model: str, rounds: int) -> dict:
    runtime = ModelRuntime.load(model)
    expected = {route: reference_tokens(runtime, prompt(n), GREEDY) for route, n in PROMPTS.items()}
    del runtime
    rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for i in range(rounds):
        for fork in (True, False) if i % 2 == 0 else (False, True):
            rows[fork].append(await one_start(model, fork, expected))
            print(f"round {i + 1} {'forked' if fork else 'fresh '}: " + "  ".join(
                f"{k} {v:.2f}" for k, v in rows[fork][-1].items()), flush=True)  # fmt: skip
    median = {fork: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for fork, rs in rows.items()}
    out = {"bench": "startup", "model": model, "rounds": rounds, "forked": median[True], "fresh": median[False]}
    out["ready_ratio"] = median[True]["ready_s"] / median[False]["ready_s"]
    out["cpu_ratio"] = median[True]["cpu_s"] / median[False]["cpu_s"]
    print(f"\n{'':8} {'ready s':>8} {'requests s':>10} {'stop s':>7} {'CPU s':>7}   (medians of {rounds})")
    for name, fork in (("forked", True), ("fresh", False)):
        m = median[fork]
        print(f"{name:8} {m['ready_s']:8.2f} {m['requests_s']:10.2f} {m['stop_s']:7.2f} {m['cpu_s']:7.2f}")
    print(f"forked / fresh: start-up {out['ready_ratio']:.2f}, CPU {out['cpu_ratio']:.2f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=positive_int, default=3, help="starts of each kind, alternating")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model served")
    p.add_argument("--quick", action="store_true", help="a smoke run: one round")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    a = p.parse_args()
    out = asyncio.run(run(a.model, 1 if a.quick else a.rounds))
    if a.json:
        print(json.dumps(figures.rounded(out)))


if __name__ == "__main__":
    main()
