"""Prefill and decode speed of every preset and shipped checkpoint on this machine, and their state sizes.

    python benchmarks/bench_runtime.py [--lengths 1024,4096] [--decode-tokens 32] [--threads 1] [--json] [--quick]

All presets and the trained checkpoints (models/checkpoints/) run in one
process, one after another, with the same prompts and torch threads, so the
figures compare side by side. Each timing is the best of --repeats runs.
``--quick`` is the smoke run the tests make: 32- and 128-token prompts, 4
decode tokens, one repeat unless given; the same code path.
"""

from __future__ import annotations

import argparse
import time

import torch

from minifaas import figures
from minifaas.commands.arguments import positive_int
from minifaas.model.interleaved_decoder import DecodeStream, generate
from minifaas.model.kv_size import kv_profile
from minifaas.model.loader import ModelSpec, checkpoint_names, load_config_dict, preset_names
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams


def measure(name: str, lengths: list[int], decode_tokens: int, repeats: int) -> dict:
    rt = ModelRuntime.load(name)
    generate(rt, [1, 2, 3], SamplingParams(max_tokens=2))  # warm up
    row: dict = {"model": name}
    for n in lengths:
        ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        best = min(rt.prefill(ids).seconds for _ in range(repeats))
        row[f"prefill_tok_s_{n}"] = n / best
        result = rt.prefill(ids)
        params = SamplingParams(max_tokens=decode_tokens + 1, ignore_eos=True)
        times = []
        for _ in range(repeats):
            stream = DecodeStream(rt, result.state, result.next_token, params)
            start = time.perf_counter()
            stream.run()
            times.append(time.perf_counter() - start)
        row[f"decode_tok_s_{n}"] = decode_tokens / min(times)
    profile = kv_profile(load_config_dict(ModelSpec.resolve(name)))
    row["kv_bytes_per_token"] = sum(c.bytes_per_token for c in profile.layers if c.window is None)
    row["fixed_state_bytes"] = sum(c.fixed_bytes for c in profile.layers)
    row["state_bytes_32k"] = profile.bytes_at(32768)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--decode-tokens", type=positive_int, default=32)
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", action="store_true", help="also print one JSON line at the end")
    p.add_argument("--quick", action="store_true", help="a smoke run: smaller sizes, the same code path")
    args = p.parse_args()
    if args.quick:  # flags given on the command line still win
        p.set_defaults(lengths="32,128", decode_tokens=4, repeats=1)
        args = p.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    models = preset_names() + checkpoint_names()
    rows = [measure(name, lengths, args.decode_tokens, args.repeats) for name in models]
    dense = next(r for r in rows if r["fixed_state_bytes"] == 0 and r["model"] == "qwen3-tiny")
    for r in rows:
        r["dense_over_this_32k"] = dense["state_bytes_32k"] / r["state_bytes_32k"]
    cols = [f"prefill_tok_s_{n}" for n in lengths] + [f"decode_tok_s_{n}" for n in lengths]
    cols += ["kv_bytes_per_token", "fixed_state_bytes", "state_bytes_32k", "dense_over_this_32k"]
    print(f"{'model':20}" + "".join(f"{c:>22}" for c in cols))
    for r in rows:
        print(
            f"{r['model']:20}" + "".join(f"{r[c]:>22.1f}" if isinstance(r[c], float) else f"{r[c]:>22}" for c in cols)
        )
    print(f"(threads: {torch.get_num_threads()}; the 32K ratio is qwen3-tiny's state over each model's)")
    if args.json:
        print(figures.dumps({"bench": "runtime", "rows": rows}))


if __name__ == "__main__":
    main()
