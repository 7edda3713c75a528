"""Chaos: concurrent greedy streams on a real gateway while its child processes are killed and stopped.

    python benchmarks/bench_chaos.py [--quick] [--json] [--seeds N] [--per-role 2 1] [--streams S]

For each ``--per-role`` count r, a real gateway on the kimi-linear-tiny preset with r PD-P, r PrfaaS and r
PD-D workers (forked from the pre-loaded parent) and the link emulator. ``--streams`` clients send greedy
requests back to back, short ones (local) and long ones (PrfaaS, across the link): first a calm round, then
per seed ``--rounds`` rounds, each while ``--faults`` faults are injected one at a time. A fault is SIGKILL,
or SIGSTOP and SIGCONT 1-4 s later (shorter and longer than the 2 s heartbeat deadline), of a process of one
kind: a PD-P, PrfaaS or PD-D worker, the link emulator or the pre-loaded parent (zygote). The (kind, signal)
pairs are dealt in a seeded order: five faults meet every kind, ten every pair.

Every request is compared with transformers' own generate() and counted: ok, wrong, cut (a true prefix,
ended with no error), failed (by the code of its OpenAI error body) or hung (it outlived the bound its
deadlines allow). After each seed the run waits for every process to be back in routing (the recovery time,
from the last fault) and checks one more request. Printed per r: those counts, the faults by kind, the
recovery times, TTFT p50/p99 calm against chaos, and the processes left after shutdown (there must be none
but the pre-loaded parent the process keeps for its next gateway).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from minifaas.config import CacheConfig, ClusterConfig, ServeConfig
from minifaas.gateway.api import api_error
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.inter_cluster_link import NAME
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.launch import forked
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.parent_watch import running

MODEL = "kimi-linear-tiny"
log = logging.getLogger("bench_chaos")
REQUEST_S = 120.0  # every request's total limit: well under the chaos test's own time limit
MAX_TOKENS = 24
KINDS = ("pd-prefill", "prfaas-prefill", "pd-decode", "link", "zygote")
SIGNALS = ("SIGKILL", "SIGSTOP")
RECOVERY_LIMIT_S = 30.0  # every process back in routing within this after the last fault, or the run fails


def config(per_role: int) -> ServeConfig:
    return ServeConfig(
        model=MODEL,
        threshold=200,
        fixed_threshold=True,
        prfaas=ClusterConfig(prefill_workers=per_role),
        pd=ClusterConfig(prefill_workers=per_role, decode_workers=per_role),
        cache=CacheConfig(mode="none"),
        heartbeat_s=0.5,
        heartbeat_deadline_s=2.0,
        first_token_timeout=30.0,
        token_timeout=10.0,
        request_timeout=REQUEST_S,  # a request moves as often as its deadlines allow: this one ends it
        prefill_timeout=15.0,
    )


def bound_s(c: ServeConfig) -> float:
    """What the deadlines allow a request at most: its total limit, and a moment for its error to arrive."""
    assert c.request_timeout is not None, "the chaos gateway bounds every request"
    return c.request_timeout + 5.0


@dataclass
class Outcomes:
    sent: int = 0
    ok: int = 0
    wrong: int = 0
    cut: int = 0
    hung: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    why: dict[str, str] = field(default_factory=dict)
    migrated: int = 0
    fell_back: int = 0
    ttft_s: list[float] = field(default_factory=list)

    def add(self, other: Outcomes) -> None:
        for name in ("sent", "ok", "wrong", "cut", "hung", "migrated", "fell_back"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.failed.update(other.failed)
        self.why.update(other.why)
        self.ttft_s += other.ttft_s

    def summary(self) -> dict:
        ttft = sorted(self.ttft_s)
        quantile = (lambda q: round(ttft[min(len(ttft) - 1, int(q * len(ttft)))], 3)) if ttft else (lambda q: None)
        return {
            "sent": self.sent, "ok": self.ok, "wrong": self.wrong, "cut": self.cut, "hung": self.hung,
            "failed": sum(self.failed.values()), "failed_by_cause": dict(self.failed), "example_errors": self.why,
            "migrated": self.migrated, "fell_back": self.fell_back,
            "ttft_p50_s": quantile(0.5), "ttft_p99_s": quantile(0.99),
        }  # fmt: skip


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [40, 90, 150, 320, 480]  # three stay local, two go to PrfaaS (threshold 200)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


class Expected:
    """Each seed's prompts and what transformers' generate() gives for them, all computed before any gateway
    starts: a reference computed on the gateway's event loop would silence its heartbeats."""

    def __init__(self, runtime: ModelRuntime, seeds: range) -> None:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        self.seeds: dict[int, tuple[list[list[int]], list[list[int]]]] = {}
        for i, seed in enumerate(seeds):
            batch = prompts(seed)
            self.seeds[seed] = batch, [reference_tokens(runtime, ids, params) for ids in batch]
            print(f"references: {i + 1} of {len(seeds)} seeds", file=sys.stderr, flush=True)

    def of(self, seed: int) -> tuple[list[list[int]], list[list[int]]]:
        return self.seeds[seed]


async def one(gw: Gateway, rid: str, ids: list[int], want: list[int], out: Outcomes) -> None:
    out.sent += 1
    record = RequestRecord(rid, len(ids))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    async def collect(tokens: list[int]) -> None:
        async for event in gw.stream(GenerateRequest(rid, ids, params), record):
            tokens.append(event.token_id)

    tokens: list[int] = []
    try:
        await asyncio.wait_for(collect(tokens), bound_s(gw.config))
    except TimeoutError:
        out.hung += 1
        return
    except Exception as e:  # every failure the client would see, as its error body's cause
        cause = api_error(e).code or type(e).__name__
        out.failed[cause] += 1
        where = f"prefill {record.prefill_worker} decode {record.decode_worker} fallback {record.fallback}"
        out.why[cause] = f"{type(e).__name__}: {e}; {record.events}; {where}"  # one example, with its history
        if cause == "internal_error":
            log.exception("request %s failed unexpectedly", rid)
        return
    out.ok += tokens == want
    out.cut += tokens != want and tokens == want[: len(tokens)]
    out.wrong += tokens != want[: len(tokens)]
    out.migrated += record.migrations > 0
    out.fell_back += record.fallback is not None
    if record.ttft_s is not None:
        out.ttft_s.append(record.ttft_s)


async def load(gw: Gateway, batch: list[list[int]], refs: list[list[int]], streams: int, until: asyncio.Event,
               tag: str) -> Outcomes:  # fmt: skip
    """``streams`` clients, each sending the prompts in turn, back to back, until ``until`` is set."""
    out = Outcomes()

    async def client(c: int) -> None:
        for i in itertools.count(c):
            if until.is_set():
                return
            await one(gw, f"{tag}-{c}-{i}", batch[i % len(batch)], refs[i % len(batch)], out)

    async with asyncio.TaskGroup() as tasks:
        for c in range(streams):
            tasks.create_task(client(c))
    return out


def targets(gw: Gateway) -> dict[str, tuple[str, int, bool]]:
    """Each child process of the gateway: its kind, its pid and whether it is in routing (or running) now."""
    procs = {name: (f"{w.cluster}-{w.role}", w.pid, w.serving) for name, w in gw.pool.workers.items()}
    if gw.link.emulator is not None:
        procs[NAME] = ("link", gw.link.emulator.pid, gw.link.up)
    forks = getattr(gw.launcher, "forks", None)
    if forks is not None and forks.parent is not None:
        procs["zygote"] = ("zygote", forks.parent.pid, forks.running)
    return procs


def back(gw: Gateway) -> bool:
    """/health says ok and every worker up (the zygote comes back when a worker next needs it)."""
    health = gw.health()
    return health["status"] == "ok" and all(state == "up" for state in health["workers"].values())


async def fault(gw: Gateway, name: str, sig: str, hold: float, seen: set[int]) -> dict:
    """One fault on ``name``, and the time until it was back in routing (None: it never left)."""
    kind, pid, _ = targets(gw)[name]
    seen.add(pid)
    start, left = time.monotonic(), False
    os.kill(pid, signal.SIGKILL if sig == "SIGKILL" else signal.SIGSTOP)  # pid > 1: never a process group
    if sig == "SIGSTOP":
        while time.monotonic() < start + hold:
            left = left or not targets(gw)[name][2]
            await asyncio.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):  # the gateway may have killed it meanwhile (a zygote)
            os.kill(pid, signal.SIGCONT)
    if kind != "zygote":
        async with asyncio.timeout(120):  # a process that never comes back ends the run, as a failure
            if sig == "SIGKILL":  # it leaves routing once its session ends (or a ping finds it gone)
                while targets(gw)[name][1:] == (pid, True):
                    await asyncio.sleep(0.01)
                left = True
            while not targets(gw)[name][2]:
                left = True
                await asyncio.sleep(0.01)
        seen.add(targets(gw)[name][1])
    recover = round(time.monotonic() - start, 2) if left else None
    return {"target": name, "kind": kind, "signal": sig, "hold_s": round(hold, 2), "recover_s": recover}


async def faults(gw: Gateway, rng: random.Random, deal: list[tuple[str, str]], count: int, seen: set[int]) -> list:
    """``count`` faults, one at a time, 1-3 s apart; each takes the next (kind, signal) of ``deal`` that has a
    process up."""
    done = []
    while len(done) < count:
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        up = targets(gw)
        for _ in range(len(deal)):
            kind, sig = deal.pop(0)
            deal.append((kind, sig))
            names = sorted(n for n, (k, pid, serving) in up.items() if k == kind and serving and pid > 1)
            if names:
                hold = rng.uniform(1.0, 4.0) if sig == "SIGSTOP" else 0.0
                done.append(await fault(gw, rng.choice(names), sig, hold, seen))
                break
    return done


def dealt(rng: random.Random) -> list[tuple[str, str]]:
    """Every (kind, signal) pair in a seeded order: each kind once in the first five (the signals mixed),
    then each again with the other signal."""
    kinds, first = rng.sample(KINDS, len(KINDS)), rng.randrange(2)
    signals = [SIGNALS[(first + i) % 2] for i in range(len(kinds))]
    return [*zip(kinds, signals), *((k, SIGNALS[SIGNALS.index(s) ^ 1]) for k, s in zip(kinds, signals))]


async def run_seed(gw: Gateway, seed: int, args: argparse.Namespace, expected: Expected, seen: set[int]) -> dict:
    rng = random.Random(seed)
    deal = dealt(rng)
    batch, want = expected.of(seed)
    out, injected = Outcomes(), []
    for r in range(args.rounds):
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            stormy = tasks.create_task(load(gw, batch, want, args.streams, stop, f"s{seed}-r{r}"))
            injected += await faults(gw, rng, deal, args.faults, seen)
            stop.set()
        out.add(stormy.result())
    last = time.monotonic()
    async with asyncio.timeout(RECOVERY_LIMIT_S):
        while not back(gw):
            await asyncio.sleep(0.05)
    recovery = time.monotonic() - last
    after = Outcomes()
    await one(gw, f"s{seed}-after", batch[-1], want[-1], after)
    seen |= {pid for _, pid, _ in targets(gw).values()}
    return {"seed": seed, "chaos": out, "faults": injected, "recovery_s": round(recovery, 2),
            "after_ok": after.ok == 1}  # fmt: skip


async def calm(gw: Gateway, args: argparse.Namespace, expected: Expected, seconds: float) -> Outcomes:
    batch, want = expected.of(args.seed)
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, stop.set)
    return await load(gw, batch, want, args.streams, stop, f"calm{seconds:g}")


async def one_config(per_role: int, args: argparse.Namespace, expected: Expected) -> dict:
    seen: set[int] = set()
    seeds, total = [], Outcomes()
    async with Gateway(config(per_role)) as gw:
        seen |= {pid for _, pid, _ in targets(gw).values()}
        await calm(gw, args, expected, 2.0)  # first forwards are slow in every process
        quiet = await calm(gw, args, expected, args.calm_s)
        for seed in range(args.seed, args.seed + args.seeds):
            result = await run_seed(gw, seed, args, expected, seen)
            chaos = result.pop("chaos")
            total.add(chaos)
            seeds.append(result)
            print(f"  r={per_role} seed {seed}: {json.dumps(chaos.summary() | {'faults': result['faults']})}",
                  flush=True)  # fmt: skip
        seen |= {pid for _, pid, _ in targets(gw).values()}
    await asyncio.sleep(0.5)  # the kernel reaps what the launcher killed last
    faults_all = [f for s in seeds for f in s["faults"]]
    return {
        "per_role": per_role,
        "calm": quiet.summary(),
        "chaos": total.summary(),
        "faults": faults_all,
        "faults_by_kind": dict(Counter(f"{f['kind']} {f['signal']}" for f in faults_all)),
        "recovery_s": [s["recovery_s"] for s in seeds],
        "after_ok": all(s["after_ok"] for s in seeds),
        # the pre-loaded parent this process shares among its gateways stays until the process ends
        "processes_left": sorted(pid for pid in seen - forked.shared_pids() if running(pid)),
    }


def report(result: dict) -> None:
    c, q = result["calm"], result["chaos"]
    print(f"\n{result['per_role']} worker(s) per role")
    print(f"{'':20}{'calm':>10}{'chaos':>10}")
    for key in ("sent", "ok", "wrong", "cut", "hung", "failed", "migrated", "fell_back", "ttft_p50_s", "ttft_p99_s"):
        print(f"{key:20}{c[key]!s:>10}{q[key]!s:>10}")
    print(f"failed by cause under chaos: {q['failed_by_cause'] or 'none'}")
    for cause, example in q["example_errors"].items():
        print(f"  {cause}: {example[:160]}")
    print(f"faults: {result['faults_by_kind']}")
    recover = [f["recover_s"] for f in result["faults"] if f["recover_s"] is not None]
    if recover:
        print(f"back in routing after a fault: median {sorted(recover)[len(recover) // 2]} s, max {max(recover)} s")
    print(f"recovery after each seed's last fault: max {max(result['recovery_s'], default=0)} s; "
          f"the request after it correct every time: {result['after_ok']}")  # fmt: skip
    print(f"processes left after shutdown: {result['processes_left'] or 'none'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one seed, one round of ten faults, 8 streams")
    p.add_argument("--json", action="store_true", help="after the tables, the result as one JSON line")
    p.add_argument("--seed", type=int, default=17, help="the first seed (default: 17)")
    p.add_argument("--seeds", type=int, help="seeds per worker count (default: 20; --quick 1)")
    p.add_argument("--per-role", type=int, nargs="+", default=[2, 1], help="workers per role, each a run (2 1)")
    p.add_argument("--streams", type=int, help="concurrent clients (default: 24; --quick 8)")
    p.add_argument("--rounds", type=int, help="rounds of faults per seed (default: 2; --quick 1)")
    p.add_argument("--faults", type=int, help="faults per round (default: 6; --quick 10)")
    p.add_argument("--calm-s", type=float, help="seconds of calm load first (default: 20; --quick 5)")
    args = p.parse_args()
    for name, full, quick in (("seeds", 20, 1), ("streams", 24, 8), ("rounds", 2, 1), ("faults", 6, 10),
                              ("calm_s", 20.0, 5.0)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    logging.basicConfig(level=logging.ERROR)
    forked.start_here(MODEL)  # the workers' parent, forked from here before any torch op
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    expected = Expected(ModelRuntime.load(MODEL), range(args.seed, args.seed + args.seeds))
    results = []
    for per_role in args.per_role:  # each table as soon as its run is over
        results.append(asyncio.run(one_config(per_role, args, expected)))
        report(results[-1])
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps({"load_average": os.getloadavg(), "seed": args.seed, "runs": results}))


if __name__ == "__main__":
    main()
