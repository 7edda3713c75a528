"""Decode throughput of one worker, continuous batching against ``--max-batch 1``, side by side.

For 1, 4, 16 and 32 concurrent streams: prefill that many prompts of mixed
lengths (not timed), then decode ``--tokens`` tokens for each with the
unbatched InterleavedDecoder (what ``--max-batch 1`` runs) and with the
BatchDecoder, and report decode tokens/s of each and their ratio, per wall
second and per CPU second of this process (on shared cores the second is the
steadier figure; ``--threads 1`` keeps it honest). Each figure is the best of
``--repeats`` runs, the two decoders alternating.

``--e2e`` adds the whole server: 32 concurrent mixed requests through the
OpenAI API of a server with batched decode and of one with ``max_batch = 1``:
throughput and TTFT / TPOT p50 and p90. ``--prefill`` measures whether
batching short prefills pays (the figures quoted in batch_decoder). The last
line is the machine-readable summary when ``--json`` is given. ``--quick`` is
the smoke run the tests make: 1 and 4 streams, 4 tokens, one repeat, 4
requests end to end, two prefill lengths unless given; the same code path.

    python benchmarks/bench_decode_batch.py
    python benchmarks/bench_decode_batch.py --threads 1 --prefill --e2e --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from minifaas import figures
from minifaas.commands.arguments import positive_int, positive_ints
from minifaas.launch import forked
from minifaas.model.batch_decoder import BatchDecoder
from minifaas.model.decoder import Decoder, DecoderConfig
from minifaas.model.interleaved_decoder import InterleavedDecoder, generate
from minifaas.model.layer_state import ModelState, new_cache
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

PROMPT_LENGTHS = (32, 96, 200, 64, 400, 128, 48, 256)  # cycled: a mix of contexts in one batch


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(count)]
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def decode_rate(decoder: Decoder, states: list[tuple[ModelState, int]], params: SamplingParams) -> tuple[float, float]:
    """Decoded tokens per wall second and per CPU second of this process, submitting every stream to the last token.

    On shared cores the CPU-time rate is what the step would reach on a quiet machine (with one torch thread).
    """
    wall, cpu = time.perf_counter(), time.process_time()
    for i, (state, first) in enumerate(states):
        decoder.submit(f"r{i}", state, first, params)
    tokens = 0
    while decoder.load:
        tokens += len(decoder.step())
    return tokens / (time.perf_counter() - wall), tokens / (time.process_time() - cpu)


def bench_decode(runtime: ModelRuntime, streams: tuple[int, ...], tokens: int, repeats: int) -> list[dict]:
    """Best of ``repeats`` for each decoder, the two alternating so that both see the same machine."""
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True)  # +1: the first token comes from prefill
    rows = []
    for n in streams:
        states = []
        for ids in prompts(n):
            result = runtime.prefill(ids, sampling=params)
            states.append((result.state, result.next_token))
        unbatched, batched = (0.0, 0.0), (0.0, 0.0)
        for _ in range(repeats):
            unbatched = max(unbatched, decode_rate(InterleavedDecoder(runtime), states, params))
            config = DecoderConfig(max_batch=max(streams))
            batched = max(batched, decode_rate(BatchDecoder(runtime, config), states, params))
        rows.append(
            {
                "streams": n,
                "max_batch_1_tok_s": unbatched[0],
                "batched_tok_s": batched[0],
                "ratio": batched[0] / unbatched[0],
                "max_batch_1_tok_cpu_s": unbatched[1],
                "batched_tok_cpu_s": batched[1],
                "ratio_cpu": batched[1] / unbatched[1],
            }
        )
        print(
            f"{n:>8} {unbatched[0]:>12.1f} {batched[0]:>10.1f} {batched[0] / unbatched[0]:>7.2f}x"
            f" {unbatched[1]:>12.1f} {batched[1]:>10.1f} {batched[1] / unbatched[1]:>7.2f}x",
            flush=True,
        )
    return rows


def bench_prefill(runtime: ModelRuntime, lengths: tuple[int, ...], batch: int, repeats: int) -> list[dict]:
    """Equal-length prompts (the best case for batching), one after another against one [batch, length] forward."""
    rows = []
    for length in lengths:
        ids = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(length))
        one_by_one = together = float("inf")  # CPU seconds of this process, best of repeats
        with torch.no_grad():
            runtime.model(input_ids=ids[:1], use_cache=True)  # warm this shape
            for _ in range(repeats):
                started = time.process_time()
                for i in range(batch):
                    runtime.model(input_ids=ids[i : i + 1], cache=new_cache(runtime.config), logits_to_keep=1)
                one_by_one = min(one_by_one, time.process_time() - started)
                started = time.process_time()
                runtime.model(input_ids=ids, cache=new_cache(runtime.config), logits_to_keep=1)
                together = min(together, time.process_time() - started)
        rows.append({"length": length, "batch": batch, "one_by_one_cpu_s": one_by_one, "batched_cpu_s": together})
        ratio = one_by_one / together
        print(f"{length:>8} {batch:>6} {one_by_one:>14.3f} {together:>12.3f} {ratio:>8.2f}x", flush=True)
    return rows


async def bench_server(model: str, max_batch: int, requests: int, seed: int = 0) -> dict:
    """Throughput and TTFT / TPOT percentiles of ``requests`` concurrent mixed streamed completions."""
    import aiohttp

    from minifaas.commands.serve import running_server
    from minifaas.config import ClusterConfig, ServeConfig

    config = ServeConfig(
        port=0,
        model=model,
        threshold=128,
        pd=ClusterConfig(prefill_workers=1, decode_workers=1, max_batch=max_batch),
    )
    gen = torch.Generator().manual_seed(seed)
    bodies = []
    for i in range(requests):
        length = PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]
        text = "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (length,), generator=gen))
        max_tokens = (8, 32, 16, 48)[i % 4]
        bodies.append({"model": model, "prompt": text, "max_tokens": max_tokens, "stream": True, "ignore_eos": True})

    async def one(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
        """The request's record, from the last chunk before [DONE] (TTFT and end to end, timed by the gateway)."""
        record: dict = {}
        async with session.post(url, json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if line.startswith(b"data: {"):
                    record = json.loads(line[6:]).get("minifaas", record)
        return record

    async with running_server(config) as (_, port), aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}/v1/completions"
        await one(session, url, bodies[0])  # warm the path
        started = time.perf_counter()
        results = await asyncio.gather(*(one(session, url, b) for b in bodies))
        wall = time.perf_counter() - started
    ttft = sorted(r["ttft_s"] for r in results)
    tpot = sorted((r["e2e_s"] - r["ttft_s"]) / max(r["completion_tokens"] - 1, 1) for r in results)
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "max_batch": max_batch,
        "requests": requests,
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_p50_s": _percentile(ttft, 0.5),
        "ttft_p90_s": _percentile(ttft, 0.9),
        "tpot_p50_s": _percentile(tpot, 0.5),
        "tpot_p90_s": _percentile(tpot, 0.9),
    }


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="kimi-linear-tiny")
    parser.add_argument(
        "--streams", type=positive_ints, default="1,4,16,32", help="concurrent streams, comma separated"
    )
    parser.add_argument("--tokens", type=positive_int, default=16, help="tokens decoded per stream")
    parser.add_argument("--e2e", action="store_true", help="also compare two servers end to end")
    parser.add_argument("--e2e-requests", type=positive_int, default=32)
    parser.add_argument("--e2e-max-batch", type=positive_int, default=32)
    parser.add_argument("--prefill", action="store_true", help="also measure batched against one-by-one prefill")
    parser.add_argument("--repeats", type=positive_int, default=2, help="best of this many runs of each measurement")
    parser.add_argument("--threads", type=positive_int, help="torch threads in this process (default: torch's choice)")
    parser.add_argument(
        "--prefill-lengths", type=positive_ints, default="16,32,128,512", help="prompt lengths of --prefill"
    )
    parser.add_argument(
        "--prefill-batch", type=positive_int, default=8, help="prompts per batched forward of --prefill"
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line of every figure")
    parser.add_argument("--quick", action="store_true", help="a smoke run: smaller sizes, the same code path")
    args = parser.parse_args()
    if args.quick:  # flags given on the command line still win
        quick = {"streams": "1,4", "tokens": 4, "repeats": 1, "e2e_requests": 4, "e2e_max_batch": 4}
        parser.set_defaults(**quick, prefill_lengths="16,32", prefill_batch=2)
        args = parser.parse_args()
    if args.e2e:
        forked.start_here(args.model)  # the workers' parent, forked from here before any torch op
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    runtime = ModelRuntime.load(args.model)
    generate(runtime, [1, 2, 3], SamplingParams(max_tokens=4))  # first forwards are slow
    threads = torch.get_num_threads()
    summary: dict = {"model": args.model, "tokens_per_stream": args.tokens, "threads": threads}

    print(f"decode tokens/s of one worker, {args.model}, {args.tokens} tokens per stream, {threads} threads")
    print(f"{'':>8} {'tokens per wall second':>31} {'tokens per CPU second':>31}")
    columns = f"{'max-batch 1':>12} {'batched':>10} {'ratio':>8}"
    print(f"{'streams':>8} {columns} {columns}")
    streams = tuple(args.streams)
    summary["decode"] = bench_decode(runtime, streams, args.tokens, args.repeats)

    if args.prefill:
        print("\nprefill: equal-length prompts one by one against one batched forward (CPU seconds)")
        print(f"{'length':>8} {'batch':>6} {'one by one':>14} {'batched':>12} {'ratio':>9}")
        lengths = tuple(args.prefill_lengths)
        summary["prefill"] = bench_prefill(runtime, lengths, args.prefill_batch, args.repeats)

    if args.e2e:
        print(f"\nend to end: {args.e2e_requests} concurrent mixed streamed requests")
        print(f"{'max_batch':>9} {'tok/s':>8} {'ttft p50':>9} {'ttft p90':>9} {'tpot p50':>9} {'tpot p90':>9}")
        summary["e2e"] = []
        for max_batch in (1, args.e2e_max_batch):
            r = asyncio.run(bench_server(args.model, max_batch, args.e2e_requests))
            summary["e2e"].append(r)
            print(
                f"{max_batch:>9} {r['tok_s']:>8.1f} {r['ttft_p50_s']:>9.3f} {r['ttft_p90_s']:>9.3f} "
                f"{r['tpot_p50_s']:>9.3f} {r['tpot_p90_s']:>9.3f}",
                flush=True,
            )
    if args.json:
        print(figures.dumps(summary))


if __name__ == "__main__":
    main()
