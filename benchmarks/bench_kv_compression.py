"""KV compression: codec ratio and speed on real states, lossy accuracy, and TTFT through the emulated link.

    python benchmarks/bench_kv_compression.py [--quick] [--json] [--only codecs|accuracy|ttft] [--models A,B]

1. codecs: every preset (and every checkpoint under models/checkpoints/), prefilled in float32,
   bfloat16 and float16 on a Shakespeare prompt; each state coded and decoded chunk by chunk as the
   transport does it (``codec_probe``), on one thread: ratio of the whole state and of its
   full-attention KV alone, and MB/s of state coded and decoded (medians of the repeats). Beside
   lossless, the same split with the coder's fallback ("full search": zstd's match finder not
   accelerated, literal coding left as zstd sets it), and zstd level 1 on the unsplit bytes, the
   baseline the byte-plane split is measured against.
2. accuracy: the lossy codes against the exact state on many prompts: the greedy continuation of the
   exact state is fed to the decoded one (teacher forcing), and at every step the argmax must agree;
   the logit error at those steps; and how many free-running continuations come out the same.
   Lossless is the control (it must agree everywhere), and "fp8, linear too" codes the
   linear-attention state as well, which no transfer does: it shows why it stays lossless.
3. ttft: one server of qwen3.5-tiny (whose KV at 10 Mbit/s takes longer to send than to compute;
   every prompt prefilled on PrfaaS, no prefix cache) and long prompts through the link emulator at
   several rates, compression off, lossless and auto interleaved request by request
   (the benchmark sets the gateway's policy mode between requests: same workers, same moment), and
   the rate below which auto codes, from the figures the gateway measured. Beside TTFT, the tail:
   prefill end to the whole state at the decode node (``transfer_s``), the part a codec can change
   once the link keeps up with prefill (TTFT itself then moves with the prefill's compute time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import torch
import zstandard

from minifaas.codec.codec import Codec
from minifaas.commands.arguments import positive_int
from minifaas.commands.serve import running_server
from minifaas.config import CacheConfig, InterClusterLinkConfig, ServeConfig
from minifaas.launch import forked
from minifaas.model.host_copy import build_cache
from minifaas.model.interleaved_decoder import DecodeStream, forward_one
from minifaas.model.layer_state import ModelState, StateKind
from minifaas.model.loader import MODELS_DIR, preset_names
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import GREEDY
from minifaas.transport.codec_probe import roundtrip
from minifaas.transport.wire import split_chunks

TEXT = Path(__file__).resolve().parents[1] / "data" / "text" / "tinyshakespeare.txt"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def models() -> list[str]:
    checkpoints = sorted(str(p) for p in (MODELS_DIR / "checkpoints").glob("*") if (p / "config.json").is_file())
    return preset_names() + checkpoints


def prompt(runtime: ModelRuntime, tokens: int, at: int) -> list[int]:
    text = TEXT.read_text()
    ids = runtime.tokenizer.encode(text[at : at + 8 * tokens])[:tokens]
    if len(ids) < tokens:
        raise ValueError(f"not {tokens} tokens of text at offset {at}")
    return ids


def kind_only(state: ModelState, kind: StateKind) -> ModelState:
    return ModelState([layer for layer in state.layers if layer.kind is kind], state.seq_len)


def zstd_whole(state: ModelState) -> tuple[int, float, float]:
    """Wire bytes, encode s and decode s of zstd level 1 on each chunk's bytes as they are."""
    cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    wire, encode_s, decode_s = 0, 0.0, 0.0
    for layer in state.layers:
        for chunk in split_chunks(layer, 1 << 20):
            start = time.perf_counter()
            packed = cctx.compress(chunk.payload)
            encode_s += time.perf_counter() - start
            start = time.perf_counter()
            dctx.decompress(packed)
            decode_s += time.perf_counter() - start
            wire += len(packed)
    return wire, encode_s, decode_s


def codec_table(names: list[str], dtypes: list[str], tokens: int, repeats: int) -> list[dict]:
    rows = []
    print(f"{'model':<18} {'dtype':<9} {'codec':<22} {'MB':>6} {'ratio':>6} {'FA':>6} {'enc MB/s':>9} {'dec MB/s':>9}")
    for name in names:
        for dtype in dtypes:
            runtime = ModelRuntime.load(name, dtype=DTYPES[dtype])
            state = runtime.prefill(prompt(runtime, tokens, 0)).state
            full = kind_only(state, StateKind.FULL_ATTENTION)
            cases = [(c.label, c, True) for c in (Codec.LOSSLESS, Codec.FP8, Codec.INT8)]
            cases += [("lossless, full search", Codec.LOSSLESS, False), ("zstd-1, unsplit", None, True)]
            for label, codec, accelerated in cases:
                samples = []
                for _ in range(repeats + 1):  # the first warms the codec's code paths up
                    if codec is None:
                        samples.append(zstd_whole(state))
                    else:
                        s = roundtrip(state, codec, accelerated=accelerated)[1]
                        samples.append((s.wire_bytes, s.encode_s, s.decode_s))
                wire = samples[-1][0]
                encode_s = statistics.median(s[1] for s in samples[1:])
                decode_s = statistics.median(s[2] for s in samples[1:])
                if codec is None:
                    fa = full.nbytes / zstd_whole(full)[0]
                else:
                    fa = full.nbytes / roundtrip(full, codec, accelerated=accelerated)[1].wire_bytes
                row = {
                    "model": runtime.spec.name, "dtype": dtype, "codec": label, "state_bytes": state.nbytes,
                    "ratio": state.nbytes / wire, "ratio_full_attention": fa,
                    "encode_mb_s": state.nbytes / encode_s / 1e6, "decode_mb_s": state.nbytes / decode_s / 1e6,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{row['model']:<18} {dtype:<9} {label:<22} {state.nbytes / 1e6:>6.2f} {row['ratio']:>6.3f} "
                    f"{fa:>6.3f} {row['encode_mb_s']:>9.0f} {row['decode_mb_s']:>9.0f}",
                    flush=True,
                )
    return rows


@torch.no_grad()
def forced(runtime: ModelRuntime, state: ModelState, first: int, tokens: list[int]) -> list[torch.Tensor]:
    """The logits after each of ``first, *tokens[:-1]`` fed to ``state`` (teacher forcing)."""
    cache = build_cache(runtime.config, state.layers, runtime.device)
    return [forward_one(runtime, cache, token) for token in [first, *tokens[:-1]]]


def accuracy(names: list[str], dtypes: list[str], prompts: int, tokens: int, steps: int) -> list[dict]:
    rows = []
    print(f"{'model':<18} {'dtype':<9} {'codec':<16} {'prompts':>7} {'agree %':>8} {'same seq %':>10} "
          f"{'max |dlogit|':>12} {'rel L2':>8}")  # fmt: skip
    cases = [("lossless", Codec.LOSSLESS, False), ("fp8", Codec.FP8, False), ("int8", Codec.INT8, False),
             ("fp8, linear too", Codec.FP8, True)]  # fmt: skip
    for name in names:
        for dtype in dtypes:
            runtime = ModelRuntime.load(name, dtype=DTYPES[dtype])
            tally = {label: {"agree": 0, "same": 0, "max": [], "rel": []} for label, _, _ in cases}
            params = replace(GREEDY, max_tokens=steps + 1, ignore_eos=True)  # the first token is prefill's
            for i in range(prompts):
                result = runtime.prefill(prompt(runtime, tokens, 7919 * i))
                continuation = DecodeStream(runtime, result.state, result.next_token, params).run()[1:]
                exact = forced(runtime, result.state, result.next_token, continuation)
                for label, codec, every_kind in cases:
                    received, _ = roundtrip(result.state, codec, every_kind=every_kind)
                    got = forced(runtime, received, result.next_token, continuation)
                    t = tally[label]
                    t["agree"] += sum(int(a.argmax() == b.argmax()) for a, b in zip(exact, got, strict=True))
                    t["max"] += [float((a - b).abs().max()) for a, b in zip(exact, got, strict=True)]
                    t["rel"] += [float((a - b).norm() / a.norm()) for a, b in zip(exact, got, strict=True)]
                    free = DecodeStream(runtime, received, result.next_token, params).run()
                    t["same"] += int(free[1:] == continuation)
            for label, _, _ in cases:
                t = tally[label]
                row = {
                    "model": runtime.spec.name, "dtype": dtype, "codec": label, "prompts": prompts,
                    "agreement": t["agree"] / (prompts * steps), "same_sequence": t["same"] / prompts,
                    "max_abs_logit_error": statistics.mean(t["max"]), "relative_logit_error": statistics.mean(t["rel"]),
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{row['model']:<18} {dtype:<9} {label:<16} {prompts:>7} {100 * row['agreement']:>8.2f} "
                    f"{100 * row['same_sequence']:>10.1f} {row['max_abs_logit_error']:>12.5f} "
                    f"{row['relative_logit_error']:>8.5f}",
                    flush=True,
                )
    return rows


async def ttft_sweep(
    model: str, rates_mbit: list[float], tokens: int, repeats: int, debug: bool = False
) -> tuple[list[dict], float]:
    config = ServeConfig(
        model=model, port=0, threshold=0, fixed_threshold=True, cache=CacheConfig(mode="none"),
        link=InterClusterLinkConfig(delay_ms=5.0),
    )  # fmt: skip
    runtime = ModelRuntime.load(model)
    modes = ("none", "lossless", "auto")
    times: dict[tuple[float, str], list[float]] = {(r, m): [] for r in rates_mbit for m in modes}
    codecs: dict[tuple[float, str], set[str]] = {key: set() for key in times}
    wire: dict[tuple[float, str], list[float]] = {key: [] for key in times}
    tails: dict[tuple[float, str], list[float]] = {key: [] for key in times}
    async with running_server(config) as (gateway, port), aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{port}/v1/completions"
        assert gateway.link is not None
        for rate in rates_mbit:
            await gateway.link.control.set_rate(rate * 1e6)
            await asyncio.sleep(2.5)  # the scheduler reads the new rate on its next ticks
            for i in range(repeats + 1):  # the first round warms this rate up
                for mode in modes[i % 3 :] + modes[: i % 3]:  # each mode goes first in turn
                    gateway.scheduler.compression.mode = mode
                    ids = prompt(runtime, tokens, 104729 * (i + 1) + int(rate) * 7 + len(mode))
                    body = {"model": gateway.model_name, "prompt": ids, "max_tokens": 2, "temperature": 0}
                    async with http.post(url, json=body) as resp:
                        info = (await resp.json())["minifaas"]
                    assert info["route"] == "prfaas", info
                    if debug:
                        print(rate, mode, i, info["kv_codec"], info["ttft_s"], info["transfer_s"], info["queue_s"])
                    if i:
                        times[rate, mode].append(info["ttft_s"])
                        codecs[rate, mode].add(info["kv_codec"])
                        wire[rate, mode].append(info["kv_bytes"] / max(info["kv_wire_bytes"], 1))
                        tails[rate, mode].append(info["transfer_s"])
                    await asyncio.sleep(0.3)  # let the link drain: each request finds it idle
        estimate = gateway.scheduler.compression.estimates.get("lossless")
    break_even_mbit = 8 * estimate.break_even_bps / 1e6 if estimate is not None else 0.0
    rows = []
    head = f"{'Mbit/s':>7} {'mode':<9} {'codec':<9} {'ratio':>6} {'TTFT s':>8} {'/ none':>7} {'tail s':>8}"
    print(f"{head} {'/ none':>7}")
    for rate in rates_mbit:
        base, base_tail = statistics.median(times[rate, "none"]), statistics.median(tails[rate, "none"])
        for mode in modes:
            ttft, tail = statistics.median(times[rate, mode]), statistics.median(tails[rate, mode])
            row = {
                "rate_mbit": rate, "mode": mode, "codec": "/".join(sorted(codecs[rate, mode])),
                "ratio": statistics.median(wire[rate, mode]), "ttft_s": ttft, "over_none": ttft / base,
                "tail_s": tail, "tail_over_none": tail / base_tail,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{rate:>7.0f} {mode:<9} {row['codec']:<9} {row['ratio']:>6.3f} {ttft:>8.3f} {ttft / base:>7.3f} "
                f"{tail:>8.3f} {tail / base_tail:>7.3f}"
            )
    print(f"auto codes below {break_even_mbit:.0f} Mbit/s (lossless as measured by the gateway; {tokens} tokens)")
    return rows, break_even_mbit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("codecs", "accuracy", "ttft"), help="run one part")
    p.add_argument(
        "--tokens", type=positive_int, default=2048, help="prompt tokens of the codec table and the TTFT sweep"
    )
    p.add_argument("--prompts", type=positive_int, default=50, help="prompts per model for accuracy")
    p.add_argument("--accuracy-tokens", type=positive_int, default=256, help="prompt tokens of the accuracy part")
    p.add_argument("--steps", type=positive_int, default=16, help="decode steps compared per prompt")
    p.add_argument(
        "--repeats", type=positive_int, default=7, help="timed passes per codec table row (the median is shown)"
    )
    p.add_argument("--rates", default="10,50,200,1000", help="link rates of the TTFT sweep, Mbit/s")
    p.add_argument("--ttft-model", default="qwen3.5-tiny", help="served in the TTFT sweep (its KV outruns prefill)")
    p.add_argument("--models", help="comma-separated models (default: every preset and shipped checkpoint)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every row")
    p.add_argument("--quick", action="store_true", help="a smoke run: smaller sizes, the same code path")
    a = p.parse_args()
    if a.quick:  # flags given on the command line still win
        p.set_defaults(tokens=256, prompts=2, accuracy_tokens=48, steps=3, repeats=1, rates="10,1000")
        a = p.parse_args()
    if a.only in (None, "ttft"):
        forked.start_here(a.ttft_model)  # the servers' workers' parent, forked from here before any torch op
    torch.set_num_threads(1)  # one core: the figures are per core, and other work shares this machine
    names = a.models.split(",") if a.models else models() if not a.quick else ["qwen3.5-tiny"]
    dtypes = list(DTYPES) if not a.quick else ["float32", "bfloat16"]
    out: dict[str, object] = {"bench": "kv_compression"}
    if a.only in (None, "codecs"):
        out["codecs"] = codec_table(names, dtypes, a.tokens, a.repeats)
    if a.only in (None, "accuracy"):
        out["accuracy"] = accuracy(names[:1] if a.quick else names, ["float32", "bfloat16"], a.prompts,
                                   a.accuracy_tokens, a.steps)  # fmt: skip
    if a.only in (None, "ttft"):
        rates = [float(r) for r in a.rates.split(",")]
        rows, break_even = asyncio.run(ttft_sweep(a.ttft_model, rates, a.tokens, a.repeats))
        out["ttft"], out["break_even_mbit"] = rows, break_even
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
