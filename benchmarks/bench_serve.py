"""TTFT and end-to-end latency of a short and a long prompt on each route, against transformers' own generate().

    python benchmarks/bench_serve.py [--short 128] [--long 2048] [--max-tokens 16] [--repeats 3] [--rounds 1]
                                     [--threads N] [--json] [--quick]

One run measures, on the same machine: a server whose threshold sends
everything local (PD-P -> PD-D), then one whose threshold sends everything to
PrfaaS (PrfaaS prefill -> emulated link -> PD-D); each served request is
followed by the reference on the same prompt, so the two see the same machine
load. The reference is what a user gets from transformers alone: the model
from ``AutoModelForCausalLM`` (``from_pretrained`` for a checkpoint, the
seeded config for a preset), greedy ``generate()`` of the same number of
tokens with no stop token, in this process. One call gives both figures: a
streamer notes when ``generate()`` hands over its first new token (TTFT: the
prefill and the first token's pick) and the call's return is the end-to-end
time. Requests go one at a time through the HTTP API with streaming, each with
a fresh prompt (no prefix-cache hits); medians of --repeats, and the median of
each request's own ratio to the reference right after it (``pairs``: slower
drift cancels). ``--rounds R`` starts R fresh servers per route, the routes'
order turning each round, and pools their requests: one server's processes
can be 10-20% faster or slower than the next one's on this kind of host, for
all of their requests, and the reference moves between servers as much.
``--quick`` is the smoke run the tests make: 32- and 128-token prompts, 4
output tokens, one repeat unless given; the same code path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field, replace

import aiohttp
import torch
from transformers.generation.streamers import BaseStreamer

from minifaas import figures
from minifaas.commands.arguments import positive_int
from minifaas.commands.serve import running_server
from minifaas.config import ClusterConfig, InterClusterLinkConfig, ServeConfig
from minifaas.launch import forked
from minifaas.model.loader import ModelSpec, load_model, resolve_dtype

# where a served prefill's time goes (the response's ``minifaas`` object); http_s is the client's TTFT less
# the gateway's: the HTTP request, the SSE event and the client's parsing
BREAKDOWN = ("dispatch_s", "queue_s", "prefill_s", "store_s", "transfer_s", "control_s", "first_step_s", "http_s")


def prompt(n: int, salt: int) -> list[int]:
    """A prompt no earlier request shares a prefix with (so no prefix cache can help)."""
    return [(37 * i + 11 * salt + 5) % 256 for i in range(n)]


class FirstToken(BaseStreamer):
    """When ``generate()`` handed over its first new token: its first ``put`` is the prompt, the second that token."""

    def __init__(self) -> None:
        self.puts, self.at = 0, 0.0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


@torch.no_grad()
def reference(model: torch.nn.Module, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """TTFT and end-to-end time of transformers' greedy ``generate()`` on ``ids``, no stop token."""
    prompt_ids = torch.tensor([ids], device=model.device)
    first = FirstToken()
    start = time.perf_counter()
    out = model.generate(
        prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=max_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None, streamer=first,
    )  # fmt: skip  # no row stops early, so no padding is written
    end = time.perf_counter()
    assert out.shape[1] == len(ids) + max_tokens and first.at
    return first.at - start, end - start


@dataclass
class Samples:
    """One route's requests at one prompt length, over every server it ran on."""

    ttfts: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    refs: list[tuple[float, float]] = field(default_factory=list)  # generate() right after each: TTFT, e2e
    parts: list[dict[str, float]] = field(default_factory=list)
    routes: set[str] = field(default_factory=set)
    kv_bytes: int = 0

    def summary(self) -> dict:
        return {
            "ttft_s": statistics.median(self.ttfts),
            "e2e_s": statistics.median(self.e2es),
            "route": "/".join(sorted(self.routes)),
            "kv_bytes": self.kv_bytes,
            "generate_ttft_s": statistics.median(r[0] for r in self.refs),
            "generate_e2e_s": statistics.median(r[1] for r in self.refs),
            "pairs": statistics.median(t / r[0] for t, r in zip(self.ttfts, self.refs, strict=True)),
            "breakdown": {k: statistics.median(b[k] for b in self.parts) for k in BREAKDOWN},
        }


async def served(
    config: ServeConfig, model: torch.nn.Module, lengths: list[int], max_tokens: int, repeats: int,
    out: dict[int, Samples], salt: int,
) -> None:  # fmt: skip
    """Each served request is followed by the same prompt through ``model``'s generate() here, so both see the
    same load."""
    async with running_server(config) as (gateway, port), aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{port}/v1/completions"
        for n in lengths:
            got = out.setdefault(n, Samples())
            for i in range(repeats + 1):  # the first is a warm-up
                ids = prompt(n, 7919 * i + n + salt)
                body = {
                    "model": gateway.model_name,
                    "prompt": ids,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                }
                start, first = time.perf_counter(), None
                async with http.post(url, json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if line.startswith("data: {") and first is None and '"choices":[{' in line:
                            first = time.perf_counter() - start
                        if '"minifaas"' in line:
                            info = json.loads(line[6:])["minifaas"]
                            got.routes.add(info["route"])
                            got.kv_bytes = info["kv_bytes"]
                if i:
                    got.parts.append(
                        {k: info[k] or 0.0 for k in BREAKDOWN[:-1]} | {"http_s": (first or 0.0) - info["ttft_s"]}
                    )
                    got.ttfts.append(first or 0.0)
                    got.e2es.append(time.perf_counter() - start)
                    got.refs.append(await asyncio.to_thread(reference, model, ids, max_tokens))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kimi-linear-tiny")
    p.add_argument("--short", type=positive_int, default=128)
    p.add_argument("--long", type=positive_int, default=2048)
    p.add_argument("--max-tokens", type=positive_int, default=16)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--link-rate", default="100mbit")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads here and per worker (0: torch's default here, each worker its share of the cores)",
    )
    p.add_argument(
        "--prefill-chunk", type=int, default=ClusterConfig().prefill_chunk, help="tokens per prefill forward"
    )
    p.add_argument("--device", default="cpu", help="every worker's device, and the reference's (cpu or cuda:N)")
    p.add_argument("--rounds", type=positive_int, default=1, help="fresh servers per route, the requests pooled")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every row")
    p.add_argument("--quick", action="store_true", help="a smoke run: smaller sizes, the same code path")
    a = p.parse_args()
    if a.quick:  # flags given on the command line still win
        p.set_defaults(short=32, long=128, max_tokens=4, repeats=1)
        a = p.parse_args()
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    if a.device == "cpu":
        forked.start_here(a.model)  # the workers' parent, forked from here before any torch op
    lengths = [a.short, a.long]
    model = load_model(ModelSpec.resolve(a.model), a.device, resolve_dtype("auto", a.device))
    reference(model, [1, 2, 3], 2)  # first forwards are slow
    if a.threads:
        torch.set_num_threads(a.threads)
    d = ServeConfig()
    base = replace(
        ServeConfig(model=a.model, port=0),
        link=InterClusterLinkConfig(rate=a.link_rate, delay_ms=5.0),
        prfaas=replace(d.prfaas, threads=a.threads, prefill_chunk=a.prefill_chunk, device=a.device),
        pd=replace(d.pd, threads=a.threads, prefill_chunk=a.prefill_chunk, device=a.device),
    )
    samples: dict[str, dict[int, Samples]] = {"local": {}, "prfaas": {}}
    thresholds = {"local": 10**9, "prfaas": 0}
    for r in range(a.rounds):  # a fresh server per route and round, the order turning with the round
        for name in ["local", "prfaas"] if r % 2 == 0 else ["prfaas", "local"]:
            config = replace(base, threshold=thresholds[name])
            asyncio.run(served(config, model, lengths, a.max_tokens, a.repeats, samples[name], 1_000_003 * r))
    local = {n: got.summary() for n, got in samples["local"].items()}
    prfaas = {n: got.summary() for n, got in samples["prfaas"].items()}
    rows = []
    for n in lengths:
        for name, res in (("local", local[n]), ("prfaas", prfaas[n])):
            rows.append(
                {
                    "prompt_tokens": n,
                    "route": res["route"],
                    "ttft_s": res["ttft_s"],
                    "e2e_s": res["e2e_s"],
                    "kv_bytes": res["kv_bytes"],
                    "generate_ttft_s": res["generate_ttft_s"],
                    "generate_e2e_s": res["generate_e2e_s"],
                    "ttft_over_generate": res["ttft_s"] / res["generate_ttft_s"],
                    "pairs": res["pairs"],
                    "asked": name,
                    "breakdown": res["breakdown"],
                }
            )
    print(
        f"{'tokens':>7} {'route':>7} {'TTFT s':>8} {'e2e s':>8} {'gen TTFT':>9} {'gen e2e':>8} "
        f"{'TTFT/gen':>9} {'pairs':>6} {'KV MB':>7}"
    )
    for r in rows:
        print(
            f"{r['prompt_tokens']:>7} {r['route']:>7} {r['ttft_s']:>8.3f} {r['e2e_s']:>8.3f} "
            f"{r['generate_ttft_s']:>9.3f} {r['generate_e2e_s']:>8.3f} {r['ttft_over_generate']:>9.2f} "
            f"{r['pairs']:>6.2f} {r['kv_bytes'] / 1e6:>7.2f}"
        )
    print(
        "\nwhere the prefill's time goes (ms, medians; the first token leaves before the transfer's tail),"
        " and the first decode step after it:"
    )
    print(f"{'tokens':>7} {'route':>7} " + " ".join(f"{k.removesuffix('_s'):>10}" for k in BREAKDOWN))
    for r in rows:
        cells = " ".join(f"{1e3 * r['breakdown'][k]:>10.1f}" for k in BREAKDOWN)
        print(f"{r['prompt_tokens']:>7} {r['route']:>7} {cells}")
    print(
        f"(link {a.link_rate}, 5 ms one way; {a.max_tokens} output tokens; medians of {a.repeats}"
        f"{f' x {a.rounds} servers per route' if a.rounds > 1 else ''}; "
        f"torch threads: {torch.get_num_threads()} here, {base.worker_threads('pd')} per worker)"
    )
    if a.json:
        print(figures.dumps({"bench": "serve", "rows": rows}))


if __name__ == "__main__":
    main()
