"""Chaos: concurrent greedy streams over HTTP on a real ``minifaas serve`` while its child processes are killed
and stopped.

    python benchmarks/bench_chaos.py [--quick] [--json] [--seeds N] [--per-role 2 1] [--streams S] [--clustered]
        [--per-stream N]

For each ``--per-role`` count r, ``minifaas serve`` on the kimi-linear-tiny preset with r PD-P, r PrfaaS and r PD-D
workers and its link emulators, in a process group of its own. ``--streams`` clients send streamed greedy requests
through the OpenAI API back to back, short ones (local) and long ones (PrfaaS, across the link), and read every
token id (``return_token_ids``): first a warm-up and a calm round, then per seed ``--rounds`` rounds, each while
``--faults`` faults are injected and until each client has sent ``--per-stream`` requests. A fault is SIGKILL, or
SIGSTOP and SIGCONT 1-4 s later (shorter and longer than the 2 s heartbeat deadline), of one process of the server:
a PD-P, PrfaaS or PD-D worker, a link emulator or the pre-loaded parent (zygote). One at a time, each waits until
its process is back in routing; the (kind, signal) pairs are dealt in a seeded order, so five faults meet every kind
and ten every pair. With ``--clustered`` a fault hits every process of one kind (two link emulators), 0-2 s apart,
and the next cluster follows 1-3 s later without waiting for the first to recover; PD-D clusters come twice as often
as the others.

Every request is compared with transformers' own generate() and counted: ok, wrong, cut (a true prefix, ended
with no error), failed (by the code of its HTTP or SSE error body) or hung (no end within the bound its
deadlines allow, below the run's own time limit). After each seed the run waits for every process to be back
in routing (the recovery time, from the last fault) and checks one more request. Printed per r: those counts,
the faults by kind, the recovery times, TTFT p50/p99 calm against chaos, and the processes of the server left
after it was stopped (there must be none).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from bench_scale import Server, serving

from minifaas.commands.arguments import count, non_negative, positive_int
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.parent_watch import running

MODEL = "kimi-linear-tiny"
REQUEST_S = 120.0  # every request's total limit: well under the chaos test's own time limit
MAX_TOKENS = 24
KINDS = ("pd-prefill", "prfaas-prefill", "pd-decode", "link-emulator", "zygote")
SIGNALS = ("SIGKILL", "SIGSTOP")
RECOVERY_LIMIT_S = 30.0  # every process back in routing within this after the last fault, or the run fails
CONFIG = """
[serve]
model = "{model}"
threshold = 200
fixed_threshold = true
heartbeat_s = 0.5
heartbeat_deadline_s = 2.0
first_token_timeout = 30.0
token_timeout = 10.0
request_timeout = {request_s}
prefill_timeout = 15.0
[prfaas]
prefill_workers = {r}
[pd]
prefill_workers = {r}
decode_workers = {r}
[cache]
mode = "none"
"""


def bound_s() -> float:
    """What the deadlines allow a request at most: its total limit, and a moment for its error to arrive."""
    return REQUEST_S + 5.0


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
    """Each seed's prompts and what transformers' generate() gives for them, computed before any server starts."""

    def __init__(self, runtime: ModelRuntime, seeds: range) -> None:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        self.seeds: dict[int, tuple[list[list[int]], list[list[int]]]] = {}
        for i, seed in enumerate(seeds):
            batch = prompts(seed)
            self.seeds[seed] = batch, [reference_tokens(runtime, ids, params) for ids in batch]
            print(f"references: {i + 1} of {len(seeds)} seeds", file=sys.stderr, flush=True)

    def of(self, seed: int) -> tuple[list[list[int]], list[list[int]]]:
        return self.seeds[seed]


@dataclass
class Answer:
    """What one streamed completion gave the client."""

    status: int = 0
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    error: dict | None = None  # the OpenAI error body, from a non-200 answer or an SSE error event
    info: dict = field(default_factory=dict)  # the ``minifaas`` object of the last chunk
    ttft_s: float | None = None


async def complete(http: aiohttp.ClientSession, url: str, ids: list[int]) -> Answer:
    """One streamed greedy completion of ``ids``, every token id read from its chunks."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}  # fmt: skip
    out, sent = Answer(), time.perf_counter()
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        out.status = resp.status
        if resp.status != 200:
            out.error = (await resp.json(content_type=None)).get("error", {})
            return out
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = chunk["error"]
                continue
            choice = chunk["choices"][0] if chunk.get("choices") else {}
            if choice.get("token_ids") and out.ttft_s is None:
                out.ttft_s = time.perf_counter() - sent
            out.tokens += choice.get("token_ids", [])
            out.finish = choice.get("finish_reason") or out.finish
            out.info = chunk.get("minifaas", out.info)
    return out


async def one(http: aiohttp.ClientSession, url: str, ids: list[int], want: list[int], out: Outcomes) -> None:
    out.sent += 1
    try:
        async with asyncio.timeout(bound_s()):
            reply = await complete(http, url, ids)
    except TimeoutError:
        out.hung += 1
        return
    except aiohttp.ClientError as e:  # the server hung up on the client: a failure the client sees
        out.failed[type(e).__name__] += 1
        out.why[type(e).__name__] = str(e)
        return
    if reply.error is not None:
        cause = reply.error.get("code") or reply.error.get("type") or f"http {reply.status}"
        out.failed[cause] += 1
        out.why[cause] = f"HTTP {reply.status}: {reply.error.get('message')}"  # one example per cause
        return
    tokens = reply.tokens
    out.ok += tokens == want and reply.finish is not None
    out.cut += tokens != want and tokens == want[: len(tokens)]
    out.wrong += tokens != want[: len(tokens)]
    out.migrated += reply.info.get("migrations", 0) > 0
    out.fell_back += reply.info.get("fallback") is not None
    if reply.ttft_s is not None:
        out.ttft_s.append(reply.ttft_s)


async def load(
    url: str, batch: list[list[int]], refs: list[list[int]], streams: int, until: asyncio.Event, at_least: int = 0
) -> Outcomes:
    """``streams`` clients, each sending the prompts in turn, back to back, until ``until`` is set and it has
    sent ``at_least`` requests."""
    out = Outcomes()

    async def client(http: aiohttp.ClientSession, c: int) -> None:
        for i in itertools.count(c):
            if until.is_set() and i - c >= at_least:
                return
            await one(http, url, batch[i % len(batch)], refs[i % len(batch)], out)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http, asyncio.TaskGroup() as tasks:
        for c in range(streams):
            tasks.create_task(client(http, c))
    return out


def processes(server: Server) -> dict[int, tuple[str, str]]:
    """pid -> (kind, name) of every live process of the server's process group: a kind of KINDS, or "other"
    (the server itself, anything untitled)."""
    found = {}
    for pid, fields in server.group():
        if fields[0] in ("Z", "X"):  # dead, not yet reaped
            continue
        with contextlib.suppress(OSError, IndexError):
            words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().split()
            kind = words[1] if words[:1] == ["minifaas"] and words[1] in KINDS else "other"
            found[pid] = (kind, words[2] if kind in KINDS[:3] else f"{kind}-{pid}")
    return found


class Deployment:
    """The server under test: its processes from /proc, and whether each is in routing from /health."""

    def __init__(self, server: Server, http: aiohttp.ClientSession) -> None:
        self.server, self.http = server, http
        self.links = 0  # link emulators the server runs when all is well

    def processes(self) -> dict[int, tuple[str, str]]:
        return processes(self.server)

    async def health(self) -> dict:
        async with self.http.get(f"{self.server.url}/health") as resp:
            return await resp.json()

    async def in_routing(self, kind: str, name: str, pid: int) -> bool:
        """The process ``pid`` is running and the server routes to it (a link: every link is up)."""
        if pid not in self.processes():
            return False
        health = await self.health()
        if kind == "link-emulator":
            return all(state == "up" for state in health["links"].values())
        return kind == "zygote" or health["workers"].get(name) == "up"

    async def back(self) -> bool:
        """/health says ok, every worker and link is up and every link emulator runs."""
        health = await self.health()
        links = sum(kind == "link-emulator" for kind, _ in self.processes().values())
        return (health["status"] == "ok" and all(s == "up" for s in health["workers"].values())
                and links >= self.links)  # fmt: skip

    def up(self, kind: str) -> list[tuple[str, int]]:
        return sorted((name, pid) for pid, (k, name) in self.processes().items() if k == kind)


async def fault(dep: Deployment, kind: str, name: str, pid: int, sig: str, hold: float) -> dict:
    """One fault on ``pid``, and the time until its process (or its successor) was back in routing (None: it
    never left)."""
    start, left = time.monotonic(), False
    os.kill(pid, signal.SIGKILL if sig == "SIGKILL" else signal.SIGSTOP)  # pid > 1: never a process group
    while sig == "SIGKILL" and running(pid):
        await asyncio.sleep(0.01)
    if sig == "SIGSTOP":
        while time.monotonic() < start + hold:
            left = left or not await dep.in_routing(kind, name, pid)
            await asyncio.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):  # the server may have killed it meanwhile
            os.kill(pid, signal.SIGCONT)
    if kind != "zygote":  # the zygote comes back when a worker next needs it
        async with asyncio.timeout(120):  # a process that never comes back ends the run, as a failure
            while not await successor_in_routing(dep, kind, name, pid):
                left = True
                await asyncio.sleep(0.05)
    recover = round(time.monotonic() - start, 2) if left else None
    return {"target": name, "kind": kind, "signal": sig, "at_s": round(start, 2), "hold_s": round(hold, 2),
            "recover_s": recover}  # fmt: skip


async def successor_in_routing(dep: Deployment, kind: str, name: str, pid: int) -> bool:
    """The faulted process, or the one that replaced it, is in routing."""
    if kind == "link-emulator":
        return (pid not in dep.processes() and await dep.back()) or await dep.in_routing(kind, name, pid)
    now = [p for n, p in dep.up(kind) if n == name]
    return bool(now) and await dep.in_routing(kind, name, now[0])


async def faults(dep: Deployment, rng: random.Random, deal: list[tuple[str, str]], count: int) -> list:
    """``count`` faults, one at a time, 1-3 s apart; each takes the next (kind, signal) of ``deal`` that has a
    process up."""
    done = []
    while len(done) < count:
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        for _ in range(len(deal)):
            kind, sig = deal.pop(0)
            deal.append((kind, sig))
            if targets := dep.up(kind):
                name, pid = rng.choice(targets)
                hold = rng.uniform(1.0, 4.0) if sig == "SIGSTOP" else 0.0
                done.append(await fault(dep, kind, name, pid, sig, hold))
                break
    return done


async def clustered_faults(dep: Deployment, rng: random.Random, count: int) -> list:
    """``count`` faults in clusters: every process of one kind (two link emulators), 0-2 s apart, each killed or
    stopped; the next cluster 1-3 s later, whether or not the last one's processes are back."""
    pending: list[asyncio.Task] = []
    while len(pending) < count:
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        kind = rng.choice([*KINDS, "pd-decode"])
        targets = dep.up(kind)
        for name, pid in rng.sample(targets, min(len(targets), 2 if kind == "link-emulator" else len(targets))):
            sig = rng.choice(SIGNALS)
            hold = rng.uniform(1.0, 4.0) if sig == "SIGSTOP" else 0.0
            pending.append(asyncio.create_task(fault(dep, kind, name, pid, sig, hold)))
            await asyncio.sleep(rng.uniform(0.0, 2.0))
    return list(await asyncio.gather(*pending))


def dealt(rng: random.Random) -> list[tuple[str, str]]:
    """Every (kind, signal) pair in a seeded order: each kind once in the first five (the signals mixed),
    then each again with the other signal."""
    kinds, first = rng.sample(KINDS, len(KINDS)), rng.randrange(2)
    signals = [SIGNALS[(first + i) % 2] for i in range(len(kinds))]
    return [*zip(kinds, signals), *((k, SIGNALS[SIGNALS.index(s) ^ 1]) for k, s in zip(kinds, signals))]


async def run_seed(dep: Deployment, seed: int, args: argparse.Namespace, expected: Expected) -> dict:
    rng = random.Random(seed)
    deal = dealt(rng)
    batch, want = expected.of(seed)
    out, injected = Outcomes(), []
    for _ in range(args.rounds):
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            stormy = tasks.create_task(load(dep.server.url, batch, want, args.streams, stop, args.per_stream))
            if args.clustered:
                injected += await clustered_faults(dep, rng, args.faults)
            else:
                injected += await faults(dep, rng, deal, args.faults)
            stop.set()
        out.add(stormy.result())
    last = time.monotonic()
    async with asyncio.timeout(RECOVERY_LIMIT_S):
        while not await dep.back():
            await asyncio.sleep(0.05)
    recovery = time.monotonic() - last
    after = Outcomes()
    await one(dep.http, dep.server.url, batch[-1], want[-1], after)
    return {"seed": seed, "chaos": out, "faults": injected, "recovery_s": round(recovery, 2),
            "after_ok": after.ok == 1}  # fmt: skip


async def calm(dep: Deployment, args: argparse.Namespace, expected: Expected, seconds: float) -> Outcomes:
    batch, want = expected.of(args.seed)
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(seconds, stop.set)
    return await load(dep.server.url, batch, want, args.streams, stop)


async def exercise(server: Server, per_role: int, args: argparse.Namespace, expected: Expected) -> dict:
    """The calm phase (its warm-up counted) and every seed's chaos on one server."""
    seeds, quiet, total = [], Outcomes(), Outcomes()
    async with aiohttp.ClientSession() as http:
        dep = Deployment(server, http)
        dep.links = sum(kind == "link-emulator" for kind, _ in dep.processes().values())
        quiet.add(await calm(dep, args, expected, 2.0))  # the warm-up: first forwards are slow in every process
        quiet.add(await calm(dep, args, expected, args.calm_s))
        for seed in range(args.seed, args.seed + args.seeds):
            result = await run_seed(dep, seed, args, expected)
            chaos = result.pop("chaos")
            total.add(chaos)
            seeds.append(result)
            print(f"  r={per_role} seed {seed}: {json.dumps(chaos.summary() | {'faults': result['faults']})}",
                  flush=True)  # fmt: skip
    faults_all = [f for s in seeds for f in s["faults"]]
    return {
        "per_role": per_role,
        "clustered": args.clustered,
        "calm": quiet.summary(),
        "chaos": total.summary(),
        "faults": faults_all,
        "faults_by_kind": dict(Counter(f"{f['kind']} {f['signal']}" for f in faults_all)),
        "recovery_s": [s["recovery_s"] for s in seeds],
        "after_ok": all(s["after_ok"] for s in seeds),
    }


def one_config(per_role: int, args: argparse.Namespace, expected: Expected) -> dict:
    """A fresh server with ``per_role`` workers per role, exercised, then stopped with SIGTERM as a user would;
    every process of its group must be gone within a minute."""
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as tmp:
        toml = Path(tmp) / "chaos.toml"
        toml.write_text(CONFIG.format(model=MODEL, request_s=REQUEST_S, r=per_role))
        with serving(["--config", str(toml)]) as server:
            result = asyncio.run(exercise(server, per_role, args, expected))
            server.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):  # still running: its processes are counted left
                server.proc.wait(timeout=60)
            time.sleep(0.5)  # the kernel reaps what the server killed last
            left = sorted(processes(server))
    return result | {"processes_left": left}


def report(result: dict) -> None:
    c, q = result["calm"], result["chaos"]
    print(f"\n{result['per_role']} worker(s) per role{', clustered faults' if result['clustered'] else ''}")
    print(f"{'':20}{'calm':>10}{'chaos':>10}")
    for key in ("sent", "ok", "wrong", "cut", "hung", "failed", "migrated", "fell_back", "ttft_p50_s", "ttft_p99_s"):
        print(f"{key:20}{c[key]!s:>10}{q[key]!s:>10}")
    print(f"failed by cause under chaos: {q['failed_by_cause'] or 'none'}")
    for cause, example in q["example_errors"].items():
        print(f"  {cause}: {example[:200]}")
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
    p.add_argument("--seed", type=count, default=17, help="the first seed (default: 17)")
    p.add_argument("--seeds", type=positive_int, help="seeds per worker count (default: 10; --quick 1)")
    p.add_argument(
        "--per-role", type=positive_int, nargs="+", default=[2, 1], help="workers per role, each a run (2 1)"
    )
    p.add_argument("--streams", type=positive_int, help="concurrent clients (default: 24; --quick 8)")
    p.add_argument("--rounds", type=positive_int, help="rounds of faults per seed (default: 3; --quick 1)")
    p.add_argument("--faults", type=count, help="faults per round (default: 8; --quick 10)")
    p.add_argument(
        "--calm-s", type=non_negative, help="seconds of calm load after the warm-up (default: 20; --quick 5)"
    )
    p.add_argument("--clustered", action="store_true", help="faults in clusters of one kind, not one at a time")
    p.add_argument("--per-stream", type=positive_int, default=3, help="requests per client per round at least (3)")
    args = p.parse_args()
    for name, full, quick in (("seeds", 10, 1), ("streams", 24, 8), ("rounds", 3, 1), ("faults", 8, 10),
                              ("calm_s", 20.0, 5.0)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    expected = Expected(ModelRuntime.load(MODEL), range(args.seed, args.seed + args.seeds))
    results = []
    for per_role in args.per_role:  # each table as soon as its run is over
        results.append(one_config(per_role, args, expected))
        report(results[-1])
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps({"load_average": os.getloadavg(), "seed": args.seed, "runs": results}))


if __name__ == "__main__":
    main()
