"""Chaos: steady mixed load on a real gateway while its workers and link emulator are killed and stopped.

    python benchmarks/bench_chaos.py [--quick] [--json] [--seed N] [--chaos-s S]

A real gateway (its PD-P, PrfaaS and two PD-D worker processes, the link
emulator) on the kimi-linear-tiny preset. Clients send a steady stream of
short (local) and long (PrfaaS, across the link) greedy requests; first a calm
run, then the same load while a seeded schedule picks a process that is up
and sends it SIGKILL, or SIGSTOP and SIGCONT after 1-4 s (shorter and longer
than the 2 s heartbeat deadline), one fault at a time.

Every request is checked against generate() and counted: ok, wrong, failed
(by the error's cause: the code of its OpenAI error body) or hung (it outlived
the bound its deadlines allow). Each fault reports the time until the process
was back in routing. TTFT p50/p90 of the calm run and of the chaos run are
printed side by side, and after shutdown every process the gateway ever
started is checked to be gone. The load average is printed first: two shared
cores move every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

from minifaas.config import CacheConfig, ClusterConfig, ServeConfig
from minifaas.gateway.api import api_error
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.inter_cluster_link import NAME
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.launch import forked
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

CONFIG = ServeConfig(
    model="kimi-linear-tiny",
    threshold=200,
    fixed_threshold=True,
    pd=ClusterConfig(prefill_workers=1, decode_workers=2),
    cache=CacheConfig(mode="none"),
    heartbeat_s=0.5,
    heartbeat_deadline_s=2.0,
    first_token_timeout=20.0,
    token_timeout=10.0,
    prefill_timeout=15.0,
)
log = logging.getLogger("bench_chaos")
MAX_TOKENS = 24
# what the deadlines allow a request at most: each attempt's first token, then every next one
BOUND_S = (CONFIG.migration_limit + 1) * CONFIG.first_token_timeout + MAX_TOKENS * CONFIG.token_timeout


@dataclass
class Outcomes:
    sent: int = 0
    ok: int = 0
    wrong: int = 0
    hung: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    why: dict[str, str] = field(default_factory=dict)
    migrated: int = 0
    fell_back: int = 0
    ttft_s: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        ttft = sorted(self.ttft_s)
        quantile = (lambda q: round(ttft[min(len(ttft) - 1, int(q * len(ttft)))], 3)) if ttft else (lambda q: None)
        return {
            "sent": self.sent, "ok": self.ok, "wrong": self.wrong, "hung": self.hung,
            "failed": sum(self.failed.values()), "failed_by_cause": dict(self.failed), "example_errors": self.why,
            "migrated": self.migrated, "fell_back": self.fell_back,
            "ttft_p50_s": quantile(0.5), "ttft_p90_s": quantile(0.9),
        }  # fmt: skip


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [40, 90, 150, 320, 480]  # three stay local, two go to PrfaaS (threshold 200)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


async def one(gw: Gateway, rid: str, ids: list[int], want: list[int], out: Outcomes) -> None:
    out.sent += 1
    record = RequestRecord(rid, len(ids))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    async def collect() -> list[int]:
        return [e.token_id async for e in gw.stream(GenerateRequest(rid, ids, params), record)]

    try:
        tokens = await asyncio.wait_for(collect(), BOUND_S)
    except TimeoutError:
        out.hung += 1
        return
    except Exception as e:  # every failure the client would see, as its error body's cause
        cause = api_error(e).code or type(e).__name__
        out.failed[cause] += 1
        out.why[cause] = f"{type(e).__name__}: {e}"  # one example of each
        if cause == "internal_error":
            log.exception("request %s failed unexpectedly", rid)
        return
    out.ok += tokens == want
    out.wrong += tokens != want
    out.migrated += record.migrations > 0
    out.fell_back += record.fallback is not None
    if record.ttft_s is not None:
        out.ttft_s.append(record.ttft_s)


async def load(gw: Gateway, batch: list[list[int]], refs: list[list[int]], seconds: float, tag: str) -> Outcomes:
    """Three clients, each sending the prompts in turn, back to back, for ``seconds``."""
    out, end = Outcomes(), time.monotonic() + seconds

    async def client(c: int) -> None:
        i = c
        while time.monotonic() < end:
            await one(gw, f"{tag}-{c}-{i}", batch[i % len(batch)], refs[i % len(batch)], out)
            i += 1

    async with asyncio.TaskGroup() as tasks:
        for c in range(3):
            tasks.create_task(client(c))
    return out


def targets(gw: Gateway) -> dict[str, tuple[int, bool]]:
    """Each process of the gateway: its pid and whether it is in routing now."""
    procs = {name: (w.pid, w.serving) for name, w in gw.workers.items()}
    if gw.link.emulator is not None:
        procs[NAME] = (gw.link.emulator.pid, gw.link.up)
    return procs


async def faults(gw: Gateway, rng: random.Random, seconds: float, seen: set[int]) -> list[dict]:
    """One fault at a time, at seeded times, until ``seconds`` have passed; each with its time to recover."""
    done, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        up = sorted(name for name, (pid, serving) in targets(gw).items() if serving and pid > 1)
        name, sig = rng.choice(up), rng.choice(["SIGKILL", "SIGSTOP"])
        pid, _ = targets(gw)[name]  # never 0: os.kill(0, ...) would signal this whole process group
        seen.add(pid)
        hold = rng.uniform(1.0, 4.0) if sig == "SIGSTOP" else 0.0
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL if sig == "SIGKILL" else signal.SIGSTOP)
        left = False
        if hold:
            until = start + hold
            while time.monotonic() < until:
                left = left or not targets(gw)[name][1]
                await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGCONT)
        async with asyncio.timeout(120):  # a process that never comes back ends the run, as a failure
            if not hold:  # killed: it leaves routing once its session ends (or a ping finds it gone)
                while targets(gw)[name] == (pid, True):
                    await asyncio.sleep(0.01)
                left = True
            while not (targets(gw)[name][1] and targets(gw)[name][0]):
                left = True
                await asyncio.sleep(0.01)
        seen.add(targets(gw)[name][0])
        recover = time.monotonic() - start if left else None
        done.append({"target": name, "signal": sig, "hold_s": round(hold, 2),
                     "recover_s": None if recover is None else round(recover, 2)})  # fmt: skip
    return done


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


async def chaos(seed: int, calm_s: float, chaos_s: float) -> dict:
    batch = prompts(seed)
    rt = ModelRuntime.load(CONFIG.model)
    refs = [rt.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for ids in batch]
    seen: set[int] = set()
    async with Gateway(CONFIG) as gw:
        seen |= {pid for pid, _ in targets(gw).values()}
        await load(gw, batch, refs, 2.0, "warm")  # first forwards are slow in every process
        calm = await load(gw, batch, refs, calm_s, "calm")
        rng = random.Random(seed)
        async with asyncio.TaskGroup() as tasks:
            stormy = tasks.create_task(load(gw, batch, refs, chaos_s, "chaos"))
            injected = tasks.create_task(faults(gw, rng, chaos_s, seen))
        seen |= {pid for pid, _ in targets(gw).values()}
    await asyncio.sleep(0.5)  # the kernel reaps what the launcher killed last
    return {
        "load_average": os.getloadavg(),
        "seed": seed,
        "calm": calm.summary(),
        "chaos": stormy.result().summary(),
        "faults": injected.result(),
        "processes_left": sorted(pid for pid in seen if alive(pid)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short calm run and 35 s of chaos")
    p.add_argument("--json", action="store_true", help="after the table, the result as one JSON line")
    p.add_argument("--seed", type=int, default=17, help="the prompts' and the faults' seed (default: 17)")
    p.add_argument("--calm-s", type=float, help="seconds of calm load (default: 30; --quick 10)")
    p.add_argument("--chaos-s", type=float, help="seconds of load under faults (default: 150; --quick 35)")
    args = p.parse_args()
    calm_s = args.calm_s or (10.0 if args.quick else 30.0)
    chaos_s = args.chaos_s or (35.0 if args.quick else 150.0)
    forked.start_here(CONFIG.model)  # the workers' parent, forked from here before any torch op
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    result = asyncio.run(chaos(args.seed, calm_s, chaos_s))
    c, q = result["calm"], result["chaos"]
    print(f"{'':28}{'calm':>10}{'chaos':>10}")
    for key in ("sent", "ok", "wrong", "hung", "failed", "migrated", "fell_back", "ttft_p50_s", "ttft_p90_s"):
        print(f"{key:28}{c[key]!s:>10}{q[key]!s:>10}")
    print(f"failed by cause under chaos: {q['failed_by_cause'] or 'none'}")
    for f in result["faults"]:
        back = "never left routing" if f["recover_s"] is None else f"back in routing after {f['recover_s']} s"
        print(f"  {f['signal']:8} {f['target']:10} held {f['hold_s']:4} s: {back}")
    print(f"processes left after shutdown: {result['processes_left'] or 'none'}")
    print(f"load average at the end {result['load_average'][0]:.2f}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
