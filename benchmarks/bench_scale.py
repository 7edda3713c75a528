"""Scale on one box: served throughput beside transformers' batched generate(), long prompts, interference, memory.

    python benchmarks/bench_scale.py [--sizes 1,32,128,256] [--crowd 1000] [--lengths 2048,8192,32000]
                                     [--soak 10000] [--repeats 2] [--check] [--out scale.json] [--plot scale.png]
                                     [--against-flags FLAGS] [--against-tree PATH] [--json]

One run, on one machine, with ``minifaas serve`` started as a user starts it (its defaults, a child process):

1. throughput: for each size N, N prompts (64 tokens in, 16 out, greedy, no stop token) through
   ``AutoModelForCausalLM.generate()`` of the same checkpoint at once, in this process, on one torch thread, then
   two, up to the cores it may use; and the same N prompts as concurrent streamed completions with ``ignore_eos``
   and ``return_token_ids``. Every served stream's tokens must equal generate()'s row for its prompt. Tokens per
   second of each side, and tokens per CPU-second: generate()'s from this process's CPU time, the server's summed
   over it and every process below it (``/proc/<pid>/stat``, the children it reaped included). generate() counts at
   its best thread count for each figure; each figure is the best of ``--repeats``, the sides taking turns on
   fresh prompts each repeat. Beside them, the workers' own model code on the same prompts in this process on
   one thread (prefill batches of a worker's budget, one batch decoder; ``one_process_run``): what the model costs
   without the deployment's processes, sockets and messages; and where the served CPU went, each process's event
   loop thread apart from its other threads (the leanest served run's). With ``--against-flags`` or
   ``--against-tree``, a second ``minifaas serve`` (those flags; the checkout at that path) is one more side taking
   turns on the same prompts, its tokens checked like the first's: two deployments measured side by side in one
   run. ``--check`` exits 1 unless served tokens/s is at least generate()'s at N = 32, 128 and 256, served tokens
   per CPU-second at least 0.8 of generate()'s at 128 and 256, and every token equal (the second server's included).
   Then ``--crowd`` concurrent requests: how many are served and how many refused.
2. long prompts: TTFT of one prompt of each of ``--lengths`` tokens, prefill tokens/s, the FLOPs the model spends
   on it (``flop_model``: matmuls, causal attention, the linear layers' chunked scan) and the FLOP/s achieved; and
   the peak RSS of the prefill worker that ran it, above what it held before the first. They run before the rest,
   while only the warm-up has touched the workers' memory: an allocator keeps what earlier batches freed, and a
   peak above that baseline would leave out what a prompt took of it.
3. interference: a burst of short streams, one prompt of the longest length, the same burst again (after over
   before); and the inter-token gaps of streams decoding while that prompt prefills, p99 over the p99 of a control
   run (new streams, the same spans, no long prompt: their contexts as long as the first ones' were), and over the
   same streams' p99 just before it.
4. memory over time: ``--soak`` requests of mixed lengths (8 to 128 tokens in, 1 to 16 out; one in a hundred
   2,048 in and 32 out), 32 at a time; every process's RSS after each tenth and its peak within each tenth, and
   their growth from the first tenth to the last.

Every process's peak RSS closes the table; ``--out`` writes every figure as JSON and ``--plot`` a PNG (with the plot
extra). ``--quick`` is the smoke run the tests make: sizes 1 and 4, 16 at once, prompts of 128 and 512 tokens, a
burst of 4, 40 soak requests; the same code path.
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
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import torch

from minifaas import figures
from minifaas.commands.arguments import count, output_file, positive, positive_int, positive_ints
from minifaas.model.kernels import select_kernels
from minifaas.model.loader import MODELS_DIR
from minifaas.process_cpu import tree_cpu_s

if TYPE_CHECKING:
    from minifaas.model.runtime import ModelRuntime

MODEL = "shakespeare-qwen3.5"
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 16
PREFILL_BATCH_TOKENS = 512  # a prefill worker's default budget of tokens in one forward (``prefill_batch``)
LETTERS = range(97, 123)  # prompts of random lowercase letters: no two share a prefix block


def prompts(count: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.choice(LETTERS) for _ in range(length)] for _ in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# --- the reference: transformers' own batched generate() --------------------------------------------------------


def load_reference() -> torch.nn.Module:
    """The checkpoint through transformers alone, on the CPU kernels the workers run (no fla on a CPU)."""
    select_kernels("cpu")
    from transformers import AutoModelForCausalLM

    path = MODELS_DIR / "checkpoints" / MODEL
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


@dataclass
class Run:
    """One side's run of one batch: each prompt's output token ids, its wall time and the CPU time it spent."""

    rows: list[list[int]]  # [] for a request refused
    wall_s: float
    cpu_s: float
    cpu_by_thread: dict[str, float] = field(default_factory=dict)  # served: each process's loop and other threads

    @property
    def tok_s(self) -> float:
        return sum(map(len, self.rows)) / self.wall_s

    @property
    def tok_cpu_s(self) -> float:
        return sum(map(len, self.rows)) / max(self.cpu_s, 1e-9)


def thread_counts() -> range:
    """generate()'s thread counts to try: one to the cores this process may run on."""
    return range(1, len(os.sched_getaffinity(0)) + 1)


def generate_run(model: torch.nn.Module, batch: list[list[int]], threads: int) -> Run:
    """One batched greedy ``generate()`` on ``threads`` torch threads, prefill included; CPU time of this process
    (every thread of it). No stop token, as ``ignore_eos`` asks of the server."""
    torch.set_num_threads(threads)
    ids = torch.tensor(batch)
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=model.config.pad_token_id, temperature=None, top_p=None, top_k=None,
        )  # fmt: skip
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert out.shape == (len(batch), PROMPT_TOKENS + OUTPUT_TOKENS)
    return Run(out[:, PROMPT_TOKENS:].tolist(), wall, cpu)


def one_process_run(runtime: ModelRuntime, batch: list[list[int]], prefill_tokens: int) -> Run:
    """The workers' own model code on ``batch`` in this process, on one thread, with no process, socket or message
    between the steps: ``prefill_batch`` on rows of at most ``prefill_tokens`` tokens together (a prefill worker's
    budget), then one ``BatchDecoder`` until every row is done. Served over this is what the deployment costs."""
    from minifaas.model.batch_decoder import BatchDecoder  # model code: after the kernel choice (load_reference)
    from minifaas.model.batch_prefill import prefill_batch
    from minifaas.model.sampling import SamplingParams

    torch.set_num_threads(1)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    rows = max(1, prefill_tokens // PROMPT_TOKENS)
    wall, cpu = time.perf_counter(), time.process_time()
    decoder = BatchDecoder(runtime)
    out: dict[str, list[int]] = {}
    for start in range(0, len(batch), rows):
        group = batch[start : start + rows]
        for k, done in enumerate(prefill_batch(runtime, group, [lambda _: None] * len(group), [params] * len(group))):
            assert not isinstance(done, Exception), done
            decoder.submit(str(start + k), done.state, done.next_token, params)
            out[str(start + k)] = [done.next_token]  # the prefill's token: the first of the output
    while decoder.load:
        for token in decoder.step():
            out[token.request].append(token.token)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return Run([out[str(k)] for k in range(len(batch))], wall, cpu)


# --- the server, as a user runs it ------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen
    url: str

    def processes(self) -> dict[str, int]:
        """Every process of the server's group, by title (``serve``, ``pd-decode pd-d0``, ...) -> pid; a title
        that two share (the link emulators') carries the pid from the second on."""
        out = {}
        for pid, _ in self.group():
            with contextlib.suppress(OSError):
                words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().split()
                title = " ".join(w for w in words[1:3] if not w.startswith(":")) if words[0] == "minifaas" else ""
                title = title or f"pid {pid}"
                out[title if title not in out else f"{title} (pid {pid})"] = pid  # three link emulators, say
        return out

    def cpu_s(self) -> float:
        """CPU seconds the server and every process below it have spent so far, as the demo counts them
        (``process_cpu``): reaped children included, so a worker that ends between two readings still counts."""
        return tree_cpu_s(self.proc.pid)

    def thread_cpu_s(self) -> dict[tuple[str, int], float]:
        """CPU seconds so far of each thread of each process, by part and thread id: the main thread's part is
        ``TITLE loop`` (its event loop), the others' ``TITLE threads`` (the forward thread, the kernels')."""
        out: dict[tuple[str, int], float] = {}
        for title, pid in self.processes().items():
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    stat = (task / "stat").read_text()
                    ticks = sum(map(int, stat[stat.rindex(")") + 2 :].split()[11:13]))  # utime, stime
                    part = f"{title} {'loop' if int(task.name) == pid else 'threads'}"
                    out[part, int(task.name)] = ticks / os.sysconf("SC_CLK_TCK")
        return out

    def group(self) -> Iterator[tuple[int, list[str]]]:
        """Each process in the server's group and the fields of its /proc stat after the command name."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
                if int(fields[2]) == self.proc.pid:
                    yield int(entry.name), fields


@contextlib.contextmanager
def serving(flags: list[str], tree: Path | None = None, start_timeout: float = 300.0) -> Iterator[Server]:
    """``minifaas serve --port 0 FLAGS`` in a process group of its own; its log goes to a file, not a pipe. With
    ``tree``, the minifaas of the checkout there (``tree_env``)."""
    argv = [sys.executable, "-m", "minifaas.commands.main", "serve", "--port", "0", *flags]
    env = tree_env(tree) if tree else None
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        log = Path(tmp) / "serve.log"
        with log.open("w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        before = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # this process stopped: the server with it
        try:
            deadline = time.monotonic() + start_timeout
            while (url := _served_url(log)) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"minifaas serve did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
            yield Server(proc, url)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            signal.signal(signal.SIGTERM, before)


def tree_env(tree: Path) -> dict[str, str]:
    """An environment whose ``python -m minifaas...`` imports the minifaas of the checkout at ``tree``: first on
    PYTHONPATH, and the working folder kept off the path (``PYTHONSAFEPATH``), where ``python -m`` puts it first.
    Refused unless ``import minifaas`` there resolves inside ``tree``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
           "PYTHONSAFEPATH": "1"}  # fmt: skip
    imported = subprocess.run([sys.executable, "-c", "import minifaas; print(minifaas.__file__)"], env=env,
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    if Path(imported).resolve().parent.parent != tree.resolve():
        raise RuntimeError(f"a server would import minifaas from {imported}, not from the tree {tree}")
    return env


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through ``serving``, which stops the server in its own session


def _served_url(log: Path) -> str | None:
    for line in log.read_text().splitlines():
        if "serving" in line and "http://" in line:
            return "http://" + line.split("http://")[1].split()[0].removesuffix(",").removesuffix("/v1")
    return None


def rss_kib(pid: int, field_name: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return 0


def reset_peak(pid: int) -> bool:
    """Start ``pid``'s VmHWM afresh from its RSS now (Linux: clear_refs 5); False where not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakSampler:
    """VmRSS of one process sampled every 20 ms, for where its peak cannot be reset."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, rss_kib(self.pid))
            self._stop.wait(0.02)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# --- the client -------------------------------------------------------------------------------------------------


@dataclass
class Stream:
    status: int = 0
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # when each content chunk came
    tokens: list[int] = field(default_factory=list)  # the output token ids, joined from the chunks' token_ids
    info: dict = field(default_factory=dict)  # the response's ``minifaas`` object
    retry_after: str | None = None

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent


async def stream(
    http: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int,
    stop: asyncio.Event | None = None, out: Stream | None = None,
) -> Stream:  # fmt: skip
    """One streamed completion of token ids, into ``out`` as it comes; ``stop`` set: leave (the server aborts)."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}  # fmt: skip
    out = out or Stream()
    out.sent = time.perf_counter()
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        out.status, out.retry_after = resp.status, resp.headers.get("Retry-After")
        if resp.status != 200:
            await resp.read()
            return out
        async for line in resp.content:
            if line.startswith(b'data: {"id"'):
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    if choice["finish_reason"] is None:
                        out.arrivals.append(time.perf_counter())
                    out.tokens += choice["token_ids"]
                if "minifaas" in chunk:
                    out.info = chunk["minifaas"]
            if stop is not None and stop.is_set():
                break
    return out


def client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None, sock_read=600)
    )


async def concurrent(url: str, batch: list[list[int]], max_tokens: int = OUTPUT_TOKENS) -> tuple[list[Stream], float]:
    """``batch`` as concurrent streamed requests; each one's stream and the wall time of all."""
    async with client() as http:
        started = time.perf_counter()
        done = await asyncio.gather(*(stream(http, url, ids, max_tokens) for ids in batch))
        return list(done), time.perf_counter() - started


def served_run(server: Server, batch: list[list[int]]) -> Run:
    """``batch`` served at once; the CPU time is the whole deployment's, the server and every process below it."""
    cpu, threads = server.cpu_s(), server.thread_cpu_s()
    done, wall = asyncio.run(concurrent(server.url, batch))
    cpu, after = server.cpu_s() - cpu, server.thread_cpu_s()
    return Run([s.tokens if s.status == 200 else [] for s in done], wall, cpu, cpu_by_part(threads, after))


def cpu_by_part(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float]) -> dict[str, float]:
    """CPU seconds each part spent between two ``thread_cpu_s`` readings, thread by thread: a thread that ended
    in between is left out (its time went with it), rather than taken off the part's other threads."""
    out: dict[str, float] = {}
    for (part, tid), cpu in after.items():
        out[part] = out.get(part, 0.0) + cpu - before.get((part, tid), 0.0)
    return {part: round(cpu, 3) for part, cpu in out.items()}


# --- the FLOP model -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopModel:
    """FLOPs of a prefill of L tokens: 2 x matmul parameters x L, causal attention 2 x layers x heads x head_dim x
    L^2, and each linear-attention layer's chunked scan, linear in L."""

    matmul_params: int  # the decoder's linear layers; the LM head runs on the last token only
    attention: int  # sum over full-attention layers of heads x head_dim
    scan_per_token: int  # FLOPs per token of every linear-attention layer's chunked gated delta rule

    @classmethod
    def of(cls, model: torch.nn.Module, chunk: int = 64) -> FlopModel:
        c = model.config
        params = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
        kinds = list(c.layer_types)
        nv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        scan = kinds.count("linear_attention") * (2 * chunk * nv * (dk + dv) + 4 * nv * dk * dv)
        return cls(params, kinds.count("full_attention") * c.num_attention_heads * c.head_dim, scan)

    def flops(self, length: int) -> float:
        return 2.0 * self.matmul_params * length + 2.0 * self.attention * length**2 + self.scan_per_token * length


# --- the phases ---------------------------------------------------------------------------------------------------


def throughput(
    server: Server,
    model: torch.nn.Module,
    runtime: ModelRuntime,
    sizes: list[int],
    repeats: int,
    rng: random.Random,
    against: Server | None = None,
) -> list:
    """At each size N: ``generate()`` at each thread count from one to this process's cores, the server, the
    ``against`` server if any, and the workers' code in one process (``one_process_run``), in turn, on the same N
    prompts (fresh ones each repeat: the same prompt again would hit the server's prefix cache); the best of
    ``repeats`` of each figure. Every served stream's tokens are checked against the row of one-thread
    ``generate()`` for its prompt, and every other thread count's rows and the one-process rows against that
    run's."""
    threads = thread_counts()
    rows = []
    for n in sizes:
        gen: dict[int, list[Run]] = {t: [] for t in threads}
        srv: list[Run] = []
        alt: list[Run] = []
        one: list[Run] = []
        unequal = generate_unequal = against_unequal = 0
        first_unequal: dict = {}  # the first prompt whose served tokens differ, both sides' tokens
        for r in range(repeats):
            batch = prompts(n, PROMPT_TOKENS, rng)
            sides = ["served", *(["against"] if against else []), "one process", *threads]
            for side in sides if r % 2 == 0 else reversed(sides):
                if side == "served":
                    srv.append(served_run(server, batch))
                elif side == "against":
                    alt.append(served_run(against, batch))
                elif side == "one process":
                    one.append(one_process_run(runtime, batch, PREFILL_BATCH_TOKENS))
                else:
                    gen[side].append(generate_run(model, batch, side))
            want = gen[1][-1].rows
            differ = [(got, row) for got, row in zip(srv[-1].rows, want, strict=True) if got != row]
            first_unequal = first_unequal or ({"served": differ[0][0], "generate": differ[0][1]} if differ else {})
            unequal += len(differ)
            if against:
                against_unequal += sum(got != row for got, row in zip(alt[-1].rows, want, strict=True))
            generate_unequal += sum(gen[t][-1].rows != want for t in threads) + (one[-1].rows != want)
        by_threads = {t: {"tok_s": max(x.tok_s for x in runs), "tok_cpu_s": max(x.tok_cpu_s for x in runs),
                          "cpu_s": min(x.cpu_s for x in runs)} for t, runs in gen.items()}  # fmt: skip
        fastest = max(threads, key=lambda t: by_threads[t]["tok_s"])
        leanest = max(threads, key=lambda t: by_threads[t]["tok_cpu_s"])
        row = {
            "n": n, "generate_threads": by_threads, "generate_best_threads": fastest,
            "generate_tok_s": by_threads[fastest]["tok_s"], "generate_cpu_best_threads": leanest,
            "generate_tok_cpu_s": by_threads[leanest]["tok_cpu_s"],
            "served_tok_s": max(x.tok_s for x in srv), "served_tok_cpu_s": max(x.tok_cpu_s for x in srv),
            "served_cpu_s": min(x.cpu_s for x in srv), "refused": sum(not got for x in srv for got in x.rows),
            "unequal": unequal, "generate_unequal": generate_unequal, "first_unequal": first_unequal,
            "one_process_tok_s": max(x.tok_s for x in one), "one_process_tok_cpu_s": max(x.tok_cpu_s for x in one),
            "served_cpu_by_thread": min(srv, key=lambda x: x.cpu_s).cpu_by_thread,  # that of the leanest run
        }  # fmt: skip
        row["ratio"] = row["served_tok_s"] / row["generate_tok_s"]
        row["cpu_ratio"] = row["served_tok_cpu_s"] / row["generate_tok_cpu_s"]
        row["tokens_equal"] = unequal == 0 and generate_unequal == 0
        if against:
            row |= {
                "against_tok_s": max(x.tok_s for x in alt),
                "against_tok_cpu_s": max(x.tok_cpu_s for x in alt),
                "against_refused": sum(not got for x in alt for got in x.rows),
                "against_unequal": against_unequal,
            }
            row["against_ratio"] = row["against_tok_s"] / row["generate_tok_s"]
            row["against_cpu_ratio"] = row["against_tok_cpu_s"] / row["generate_tok_cpu_s"]
            row["tokens_equal"] = row["tokens_equal"] and against_unequal == 0
        rows.append(row)
        print(f"{n:>6} {row['generate_tok_s']:>9.1f} ({fastest}) {row['generate_tok_cpu_s']:>9.1f} ({leanest}) "
              f"{row['served_tok_s']:>9.1f} {row['served_tok_cpu_s']:>9.1f} {row['ratio']:>6.2f}x "
              f"{row['cpu_ratio']:>6.2f}x {row['refused']:>7} {unequal:>7} {row['one_process_tok_s']:>9.1f}"
              + (f" | against {row['against_tok_s']:>9.1f} {row['against_tok_cpu_s']:>9.1f} "
                 f"{row['against_ratio']:>6.2f}x {row['against_cpu_ratio']:>6.2f}x {row['against_refused']:>7} "
                 f"{against_unequal:>7}" if against else ""), flush=True)  # fmt: skip
        parts = sorted(row["served_cpu_by_thread"].items(), key=lambda kv: -kv[1])
        print("       served CPU-s by thread: " + ", ".join(f"{part} {cpu:.2f}" for part, cpu in parts if cpu >= 0.01))
    return rows


# what --check holds the throughput to: (figure, the sizes it applies at, at least)
THRESHOLDS = (("ratio", (32, 128, 256), 1.0), ("cpu_ratio", (128, 256), 0.8))


def checks(rows: list[dict]) -> list[dict]:
    """Each threshold at each size measured, and every size's tokens equal to generate()'s."""
    out = []
    for figure, sizes, least in THRESHOLDS:
        for row in (r for r in rows if r["n"] in sizes):
            out.append({"check": f"{figure} >= {least}", "n": row["n"], "value": row[figure],
                        "ok": row[figure] >= least})  # fmt: skip
    for row in rows:
        out.append({"check": "tokens equal", "n": row["n"], "value": row["unequal"] + row["generate_unequal"],
                    "ok": row["tokens_equal"]})  # fmt: skip
    return out


def crowd(server: Server, n: int, rng: random.Random) -> dict:
    cpu = server.cpu_s()
    done, wall = asyncio.run(concurrent(server.url, prompts(n, PROMPT_TOKENS, rng)))
    cpu = server.cpu_s() - cpu
    served = [s for s in done if s.status == 200 and len(s.tokens) == OUTPUT_TOKENS]
    refused = [s for s in done if s.status != 200]
    ttfts = [s.ttft for s in served]
    tokens = sum(len(s.tokens) for s in done)
    row = {"n": n, "served": len(served), "refused": len(refused), "tok_s": tokens / wall,
           "tok_cpu_s": tokens / max(cpu, 1e-9), "cpu_s": cpu, "ttft_p50_s": percentile(ttfts, 0.5),
           "ttft_p99_s": percentile(ttfts, 0.99), "wall_s": wall}  # fmt: skip
    print(f"{n} at once: {len(served)} served, {len(refused)} refused, {row['tok_s']:.1f} tok/s, "
          f"{row['tok_cpu_s']:.1f} tok per CPU-s, TTFT p50 {row['ttft_p50_s']:.2f} s, "
          f"p99 {row['ttft_p99_s']:.2f} s", flush=True)  # fmt: skip
    return row


def long_prompts(server: Server, flop: FlopModel, lengths: list[int], rng: random.Random) -> list[dict]:
    """One prompt of each length, alone, shortest first: TTFT, prefill tokens/s, FLOP/s, and the peak RSS of the
    prefill worker that ran it above its RSS before the first (the C allocator keeps what a prompt freed for the
    next, so a peak over that baseline is what the longest prompt so far needed; each prompt's blocks stay cached)."""
    rows = []
    workers = {t: pid for t, pid in server.processes().items() if "-prefill " in t}
    idle = {t: rss_kib(pid) for t, pid in workers.items()}
    for length in lengths:
        reset = all(reset_peak(pid) for pid in workers.values())
        with contextlib.ExitStack() as samplers:
            sampled = {t: samplers.enter_context(PeakSampler(pid)) for t, pid in workers.items()}
            (done,), _ = asyncio.run(concurrent(server.url, prompts(1, length, rng), max_tokens=1))
        title = next(t for t in workers if t.endswith(" " + str(done.info.get("prefill_worker"))))
        peak = rss_kib(workers[title], "VmHWM") if reset else sampled[title].peak
        ttft, work = done.ttft, flop.flops(length)
        rows.append({"tokens": length, "ttft_s": ttft, "prefill_tok_s": length / ttft, "gflop": work / 1e9,
                     "gflop_s": work / ttft / 1e9, "worker": title, "rss_idle_mib": idle[title] / 1024,
                     "peak_rss_above_idle_mib": (peak - idle[title]) / 1024})  # fmt: skip
        r = rows[-1]
        print(f"{length:>7} {ttft:>8.2f} {r['prefill_tok_s']:>10.0f} {r['gflop']:>9.1f} {r['gflop_s']:>8.2f} "
              f"{r['peak_rss_above_idle_mib']:>12.1f}  {title}", flush=True)  # fmt: skip
    return rows


def interference(server: Server, length: int, burst: int, streams: int, baseline_s: float, rng: random.Random) -> dict:
    """A burst of short streams before and after one long prompt; the inter-token gaps of streams decoding while
    that prompt prefills, against the same streams' gaps just before it and against a control run of new streams
    over the same spans with no long prompt (the streams' contexts grow as they decode: only the control has the
    lengths the streams had during the prefill)."""
    _, before = asyncio.run(concurrent(server.url, prompts(burst, PROMPT_TOKENS, rng)))
    gaps = asyncio.run(_gaps_around(server.url, prompts(streams, PROMPT_TOKENS, rng), length, baseline_s, rng))
    _, after = asyncio.run(concurrent(server.url, prompts(burst, PROMPT_TOKENS, rng)))
    control = asyncio.run(_gaps_around(server.url, prompts(streams, PROMPT_TOKENS, rng), 0, baseline_s, rng,
                                       gaps["ttft"]))  # fmt: skip
    quiet, during, alone = (percentile(g, 0.99) for g in (gaps["before"], gaps["during"], control["during"]))
    row = {"burst": burst, "burst_before_s": before, "burst_after_s": after, "after_over_before": after / before,
           "streams": streams, "itl_p99_before_s": quiet, "itl_p99_during_s": during, "itl_p99_control_s": alone,
           "itl_ratio": during / alone, "itl_ratio_over_before": during / quiet, "gaps_before": len(gaps["before"]),
           "gaps_during": len(gaps["during"]), "gaps_control": len(control["during"]),
           "long_ttft_s": gaps["ttft"]}  # fmt: skip
    print(f"a burst of {burst}: {before:.2f} s before a {length}-token prompt, {after:.2f} s after "
          f"({after / before:.2f}x)", flush=True)  # fmt: skip
    print(f"inter-token p99 of {streams} streams: {1e3 * during:.0f} ms while it prefilled ({len(gaps['during'])} "
          f"gaps in {gaps['ttft']:.1f} s), {1e3 * alone:.0f} ms over the same span without it ({during / alone:.2f}x), "
          f"{1e3 * quiet:.0f} ms just before it ({during / quiet:.2f}x)", flush=True)  # fmt: skip
    return row


async def _gaps_around(
    url: str, batch: list[list[int]], length: int, baseline_s: float, rng: random.Random, span_s: float = 0.0
) -> dict:
    """The gaps of ``batch``'s streams over ``baseline_s`` and then while one prompt of ``length`` tokens prefills;
    with ``length`` 0, over ``baseline_s`` and then ``span_s`` of nothing else (the control)."""
    stop, live = asyncio.Event(), [Stream() for _ in batch]
    async with client() as http:
        running = [asyncio.create_task(stream(http, url, ids, 30_000, stop, s)) for ids, s in zip(batch, live)]
        async with asyncio.timeout(600):
            while min(len(s.arrivals) for s in live) < 8:  # every stream past its first steps
                await asyncio.sleep(0.05)
        quiet_from = time.perf_counter()
        await asyncio.sleep(baseline_s)
        if length:
            long = await stream(http, url, prompts(1, length, rng)[0], OUTPUT_TOKENS)
            sent, first = long.sent, long.arrivals[0]
        else:
            sent = time.perf_counter()
            await asyncio.sleep(span_s)
            first = time.perf_counter()
        stop.set()
        await asyncio.gather(*running)
    gaps: dict = {"before": [], "during": [], "ttft": first - sent}
    for s in live:
        times = s.arrivals
        for a, b in itertools.pairwise(times):
            if quiet_from <= b < sent:
                gaps["before"].append(b - a)
            elif sent <= b <= first:
                gaps["during"].append(b - a)
    return gaps


def soak(server: Server, requests: int, concurrency: int, rng: random.Random) -> dict:
    """``requests`` of mixed lengths, ``concurrency`` at a time; every process's RSS after each tenth of them and its
    peak within that tenth (where the peak can be reset), and their growth from the first tenth to the last: what
    a process holds at one instant moves with the batch it holds then, its peak over a tenth with the worst batch."""
    pids = server.processes()
    resettable = all(reset_peak(pid) for pid in pids.values())
    mixed = [(int(8 * 2 ** (4 * rng.random())), rng.choice((1, 4, 16))) for _ in range(requests)]  # 8-128 in
    for i in range(0, requests, 100):  # one in a hundred is long, past the threshold, with a longer output
        mixed[i] = (2048, 32)
    batches = [prompts(1, n, rng)[0] for n, _ in mixed]
    curve: list[dict[str, int]] = []  # RSS (KiB) by process after each tenth
    tops: list[dict[str, int]] = []  # peak RSS (KiB) by process within each tenth
    started = time.perf_counter()

    async def run() -> int:
        done, queue = 0, iter(range(requests))
        async with client() as http:

            async def worker() -> None:
                nonlocal done
                for i in queue:
                    s = await stream(http, server.url, batches[i], mixed[i][1])
                    done += s.status == 200
                    if done % max(1, requests // 10) == 0 and len(curve) < done * 10 // requests:
                        curve.append({t: rss_kib(pid) for t, pid in pids.items()})
                        line = " ".join(f"{v / 1024:.0f}" for v in curve[-1].values())
                        if resettable:
                            tops.append({t: rss_kib(pid, "VmHWM") for t, pid in pids.items()})
                            line += " (peak " + " ".join(f"{v / 1024:.0f}" for v in tops[-1].values()) + ")"
                            for pid in pids.values():
                                reset_peak(pid)
                        print(f"  {done:>6} served, {time.perf_counter() - started:>5.0f} s: {line}", flush=True)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done

    print(f"{requests} mixed requests, {concurrency} at a time; RSS MiB of " + ", ".join(pids))
    ok = asyncio.run(run())
    end = {t: rss_kib(pid) for t, pid in pids.items()}
    first = curve[0] if curve else end
    growth = {t: end[t] / first[t] - 1 for t in pids if first.get(t)}
    peak_growth = {t: tops[-1][t] / tops[0][t] - 1 for t in pids if tops and tops[0].get(t)}
    row = {"requests": requests, "served": ok, "wall_s": time.perf_counter() - started, "growth": growth,
           "peak_growth": peak_growth, "rss_mib": [{t: v / 1024 for t, v in point.items()} for point in curve],
           "peak_mib": [{t: v / 1024 for t, v in point.items()} for point in tops]}  # fmt: skip
    print(f"{ok} of {requests} served in {row['wall_s']:.0f} s; RSS from the first tenth to the end: "
          + ", ".join(f"{t} {100 * g:+.1f}%" for t, g in growth.items()), flush=True)  # fmt: skip
    if peak_growth:
        print("peak RSS within the last tenth over the first: "
              + ", ".join(f"{t} {100 * g:+.1f}%" for t, g in peak_growth.items()), flush=True)  # fmt: skip
    return row


def peaks(server: Server) -> dict[str, float]:
    return {t: rss_kib(pid, "VmHWM") / 1024 for t, pid in server.processes().items()}


def plot(summary: dict, path: Path) -> bool:
    """Throughput (per second and per CPU-second) by size; prefill FLOP/s and peak RSS by length; RSS over the soak.
    False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4), dpi=100)
    rows = summary["throughput"]
    n = [r["n"] for r in rows]
    a.plot(n, [r["generate_tok_s"] for r in rows], marker="o", label="transformers generate()")
    a.plot(n, [r["served_tok_s"] for r in rows], marker="o", label="served (minifaas serve)")
    a.plot(n, [r["generate_tok_cpu_s"] for r in rows], "C0--", marker="x", label="generate(), per CPU-s")
    a.plot(n, [r["served_tok_cpu_s"] for r in rows], "C1--", marker="x", label="served, per CPU-s")
    a.set(xscale="log", xlabel="concurrent requests (batch)", ylabel="output tokens per s and per CPU-s",
          title="throughput")  # fmt: skip
    a.legend()
    long = summary.get("long_prompts", [])
    lengths = [r["tokens"] for r in long]
    b.plot(lengths, [r["peak_rss_above_idle_mib"] for r in long], marker="o", label="peak RSS MiB")
    b.plot(lengths, [r["gflop_s"] for r in long], marker="s", label="prefill GFLOP/s")
    b.set(xlabel="prompt tokens", title="long prompts: prefill worker")
    if long:
        b.set(xscale="log", yscale="log")
        b.legend()
    curve = summary.get("soak", {}).get("rss_mib", [])
    for title in curve[0] if curve else ():
        c.plot([(i + 1) / 10 for i in range(len(curve))], [point[title] for point in curve], marker=".", label=title)
    c.set(xlabel="share of the soak's requests served", ylabel="RSS MiB", title="memory over the soak")
    if curve:
        c.legend(fontsize=7)
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def long_prompt_table(server: Server, flop: FlopModel, lengths: list[int], rng: random.Random) -> dict:
    """``long_prompts`` printed as a table, with FLOP/s and peak RSS of the longest over the shortest and previous."""
    print(f"long prompts, one at a time; FLOPs = 2 x {flop.matmul_params:,} x L + 2 x {flop.attention} x L^2 "
          f"+ {flop.scan_per_token:,} x L")  # fmt: skip
    print(f"{'tokens':>7} {'TTFT s':>8} {'prefill/s':>10} {'GFLOP':>9} {'GFLOP/s':>8} {'peak RSS MiB':>12}")
    rows = long_prompts(server, flop, lengths, rng)
    out = {"long_prompts": rows, "flop_s_longest_over_shortest": rows[-1]["gflop_s"] / rows[0]["gflop_s"],
           "rss_longest_over_previous": rows[-1]["peak_rss_above_idle_mib"]
           / max(rows[-2]["peak_rss_above_idle_mib"] if len(rows) > 1 else 1.0, 1e-9)}  # fmt: skip
    previous = lengths[-2] if len(lengths) > 1 else lengths[0]
    print(
        f"achieved FLOP/s at {lengths[-1]} over {lengths[0]}: {out['flop_s_longest_over_shortest']:.2f}; "
        f"peak RSS at {lengths[-1]} over {previous}: {out['rss_longest_over_previous']:.2f}\n",
        flush=True,
    )
    return out


def numbers(text: str) -> list[int]:
    """Comma-separated integers >= 1: "1,32,128" -> [1, 32, 128]; "" -> [] (that phase is skipped)."""
    return positive_ints(text) if text.strip() else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=numbers, default="1,32,128,256", help="concurrent requests / generate() batch sizes")
    p.add_argument("--crowd", type=count, default=1000, help="requests sent at once, all to be served (0: none)")
    p.add_argument("--lengths", type=numbers, default="2048,8192,32000",
                   help="long prompts' tokens, shortest first ('': none)")  # fmt: skip
    p.add_argument("--burst", type=count, default=100,
                   help="short streams before and after the longest prompt (0: none)")  # fmt: skip
    p.add_argument("--streams", type=count, default=8, help="streams decoding while the longest prompt prefills")
    p.add_argument("--baseline", type=positive, default=5.0, help="seconds of their gaps measured before it")
    p.add_argument("--soak", type=count, default=10_000, help="mixed requests for memory over time (0: none)")
    p.add_argument("--repeats", type=positive_int, default=2, help="best of this many runs of each throughput figure")
    p.add_argument("--serve-flags", default="", help="more flags for minifaas serve (default: none, its defaults)")
    p.add_argument("--against-flags", help="a second minifaas serve with these flags, one more side of the "
                   "throughput phase (default: none)")  # fmt: skip
    p.add_argument("--against-tree", type=Path, metavar="PATH",
                   help="run the second minifaas serve from the checkout at PATH (default: this one)")  # fmt: skip
    p.add_argument("--out", type=output_file, help="write every figure as JSON here")
    p.add_argument("--plot", type=output_file, help="write a PNG of throughput and long prompts here")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every figure")
    p.add_argument("--quick", action="store_true", help="a smoke run: smaller sizes, the same code path")
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless served tok/s is at least generate()'s at N = 32, 128, 256, served tok per CPU-s at least "
        "0.8x at 128 and 256, and every token equal",
    )
    a = p.parse_args()
    if a.quick:  # flags given on the command line still win
        p.set_defaults(sizes="1,4", crowd=16, lengths="128,512", burst=4, streams=2, baseline=0.5, soak=40,
                       repeats=1)  # fmt: skip
        a = p.parse_args()
    lengths = a.lengths
    if a.against_tree is not None and not (a.against_tree / "minifaas" / "__init__.py").is_file():
        p.error(f"--against-tree {a.against_tree}: not a minifaas checkout")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the server's group is stopped on the way out
    rng = random.Random(0)
    model = load_reference()
    for threads in thread_counts():  # first forwards are slow
        generate_run(model, prompts(2, PROMPT_TOKENS, rng), threads)
    flop = FlopModel.of(model)
    summary: dict = {"model": MODEL, "load_average_start": os.getloadavg()[0], "flop_model": vars(flop)}
    with serving(a.serve_flags.split()) as server, contextlib.ExitStack() as stack:
        asyncio.run(concurrent(server.url, prompts(4, PROMPT_TOKENS, rng)))  # the served path warm
        against = None
        if a.against_flags is not None or a.against_tree is not None:
            tree = a.against_tree.resolve() if a.against_tree else None
            against = stack.enter_context(serving((a.against_flags or "").split(), tree))
            asyncio.run(concurrent(against.url, prompts(4, PROMPT_TOKENS, rng)))
            summary["against"] = {"flags": a.against_flags or "", "tree": str(tree or "")}
        if lengths:  # first: the prefill workers' memory as only the warm-up left it
            summary.update(long_prompt_table(server, flop, lengths, rng))
        print(f"output tokens per second and per CPU-second, {PROMPT_TOKENS} tokens in and {OUTPUT_TOKENS} out, "
              f"{MODEL}, best of {a.repeats}; generate() B=N at its best thread count for each (threads)")  # fmt: skip
        print(
            "ratio: served over generate(), per second and per CPU-second; unequal: served streams whose tokens "
            "are not generate()'s; 1 proc/s: the workers' model code in this process on one thread, no sockets"
        )
        print(f"{'N':>6} {'gen tok/s':>13} {'gen /CPU-s':>13} {'served/s':>9} {'/CPU-s':>9} {'ratio':>7} "
              f"{'per CPU':>7} {'refused':>7} {'unequal':>7} {'1 proc/s':>9}")  # fmt: skip
        from minifaas.model.runtime import ModelRuntime  # model code: after the kernel choice (load_reference)

        runtime = ModelRuntime.load(str(MODELS_DIR / "checkpoints" / MODEL))
        summary["throughput"] = throughput(server, model, runtime, a.sizes, a.repeats, rng, against)
        summary["checks"] = checks(summary["throughput"])
        if a.crowd:
            summary["crowd"] = crowd(server, a.crowd, rng)
        if lengths and a.burst:
            print()
            summary["interference"] = interference(server, lengths[-1], a.burst, a.streams, a.baseline, rng)
        lifetime = [peaks(server)]  # the soak starts each process's peak afresh each tenth
        if a.soak:
            print()
            summary["soak"] = soak(server, a.soak, 32, rng)
            lifetime += summary["soak"]["peak_mib"]
        summary["peak_rss_mib"] = {t: max(v, *(p.get(t, 0.0) for p in lifetime)) for t, v in peaks(server).items()}
    print("\npeak RSS per process (MiB): " + ", ".join(f"{t} {v:.0f}" for t, v in summary["peak_rss_mib"].items()))
    summary["load_average_end"] = os.getloadavg()[0]
    start, end = summary["load_average_start"], summary["load_average_end"]
    print(f"load average: {start:.1f} at the start, {end:.1f} at the end")
    if a.out:
        Path(a.out).write_text(figures.dumps(summary, indent=1) + "\n")
    if a.plot and plot(summary, Path(a.plot)):
        print(f"plot: {a.plot}")
    failed = [c for c in summary["checks"] if not c["ok"]]
    print("checks: " + ("all hold" if not failed else "; ".join(f"{c['check']} at N={c['n']}: {c['value']:.3g}"
                                                                  for c in failed)))  # fmt: skip
    if a.json:
        print(figures.dumps(summary))
    if a.check and failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
