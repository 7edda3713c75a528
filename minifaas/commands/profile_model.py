"""``minifaas profile``: measure one instance of a model on a device, write the profile the planner reads.

    minifaas profile --model kimi-linear-tiny --device cpu --out cpu.json

Prefill: each length's median wall time and the bytes of state it leaves. Decode: the step time for each batch
size, and BS_max, the largest batch whose step meets ``--slo`` (a lower bound when even the largest does); the
largest batch again with longer rows, for what a step adds per token of the batch's width.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from minifaas.commands import arguments
from minifaas.commands.arguments import add_model_arguments
from minifaas.commands.main import BadInput, user_input
from minifaas.model.loader import checked_spec, resolve_dtype
from minifaas.planner.profile import DecodeProfile, PrefillProfile, ProfilePoint, fit_kv, fit_latency, save_profiles

if TYPE_CHECKING:
    from minifaas.model.runtime import ModelRuntime

DECODE_CONTEXT = 64  # tokens each row holds as the decode steps are timed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--device", type=arguments.device, default="cpu", help="cpu or cuda:N")
    parser.add_argument(
        "--lengths", type=arguments.positive_ints, default="64,256,1024", help="prompt lengths in tokens (two or more)"
    )
    parser.add_argument("--batches", type=arguments.positive_ints, default="1,2,4,8", help="decode batch sizes")
    parser.add_argument("--decode-steps", type=int, default=8, help="steps timed per batch size")
    parser.add_argument(
        "--decode-context",
        type=int,
        default=1024,
        help=f"a second row length (tokens; the steps are timed at {DECODE_CONTEXT}) at which the largest batch is "
        "timed again: what a step adds per row for each token of the batch's width",
    )
    parser.add_argument(
        "--unbatched", action="store_true", help="time decode one forward per request (workers' --max-batch 1)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="prefills timed per length (the median is kept)")
    parser.add_argument(
        "--slo",
        type=arguments.positive,
        default=40.0,
        help="decode SLO in tokens/s per request: BS_max is the largest batch meeting it",
    )
    parser.add_argument("--gpus-per-instance", type=arguments.positive_int, default=1,
                        help="GPUs one instance of the model uses")  # fmt: skip
    parser.add_argument("--name", help="profile name (default: MODEL@DEVICE)")
    parser.add_argument(
        "--out", type=arguments.output_file, default="profile.json", help="where to write the profile (JSON)"
    )


def measure_prefill(runtime: ModelRuntime, lengths: list[int], repeats: int) -> tuple[ProfilePoint, ...]:
    points = []
    for n in lengths:
        ids = [(31 * i + 7) % 256 for i in range(n)]
        runs = [runtime.prefill(ids) for _ in range(repeats)]
        points.append(ProfilePoint(n, statistics.median(r.seconds for r in runs), float(runs[-1].state.nbytes)))
    return tuple(points)


def measure_decode(
    runtime: ModelRuntime, batches: list[int], steps: int, batched: bool, context: int = DECODE_CONTEXT
) -> list[tuple[int, float]]:
    """Seconds per step with B requests of ``context`` tokens decoding, for each B, on the decoder a decode
    worker runs."""
    from minifaas.model.batch_decoder import make_decoder
    from minifaas.model.decoder import DecoderConfig
    from minifaas.model.sampling import SamplingParams

    prompt = runtime.prefill([(13 * i + 5) % 256 for i in range(context)])
    sampling = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    out = []
    for b in batches:
        decoder = make_decoder(runtime, DecoderConfig(max_batch=max(b, 2) if batched else 1))
        for i in range(b):
            decoder.submit(f"r{i}", prompt.state, prompt.next_token, sampling)
        decoder.step()  # admission (the states are copied in) and first-call allocations: not timed
        started = time.perf_counter()
        for _ in range(steps):
            decoder.step()
        out.append((b, (time.perf_counter() - started) / steps))
    return out


def run(args: argparse.Namespace) -> int:
    from minifaas.model.runtime import ModelRuntime  # torch is loaded only here

    lengths, batches = sorted(set(args.lengths)), sorted(set(args.batches))
    if len(lengths) < 2 or args.repeats < 1 or args.decode_steps < 1 or args.slo <= 0:
        raise BadInput("need two different lengths or more, --repeats and --decode-steps >= 1 and --slo > 0")
    if args.decode_context <= DECODE_CONTEXT:
        raise BadInput(f"--decode-context must be more than the {DECODE_CONTEXT} tokens the steps are timed at")
    with user_input():
        arguments.present_device(args.device)
        checked_spec(args.model, args.trust_remote_code)
        dtype = resolve_dtype(args.dtype, args.device)
    runtime = ModelRuntime.load(args.model, args.device, dtype=dtype, trust_remote_code=args.trust_remote_code)
    if max(lengths[-1], args.decode_context + args.decode_steps) > runtime.max_context:
        raise BadInput(f"--lengths and --decode-context must fit the model's context of {runtime.max_context} tokens")
    name = args.name or f"{args.model}@{args.device}"
    runtime.prefill([1, 2, 3, 4])  # warm-up: first-call allocations are not the model's speed
    points = measure_prefill(runtime, lengths, args.repeats)
    # a longer prompt never prefills faster: a dip is timing noise (other work on the machine)
    slowest = np.maximum.accumulate([p.latency_s for p in points])
    points = tuple(ProfilePoint(p.tokens, float(s), p.kv_bytes) for p, s in zip(points, slowest))
    fixed, per_token = fit_kv(points)
    prefill = PrefillProfile(
        name=name,
        gpus_per_instance=args.gpus_per_instance,
        points=points,
        latency_coeffs=_latency_model(points),
        kv_fixed_bytes=max(fixed, 0.0),
        kv_bytes_per_token=per_token,
    )
    steps = measure_decode(runtime, batches, args.decode_steps, not args.unbatched)
    ((largest, wide_s),) = measure_decode(
        runtime, batches[-1:], args.decode_steps, not args.unbatched, args.decode_context
    )
    slot_s = max(0.0, wide_s - steps[-1][1]) / (largest * (args.decode_context - DECODE_CONTEXT))
    print(f"{name}: prefill")
    for p in points:
        print(f"  {p.tokens:>7} tokens  {p.latency_s:8.4f} s  {p.kv_bytes / 2**20:9.3f} MiB")
    print(f"  KV = {prefill.kv_fixed_bytes:,.0f} B + {per_token:,.1f} B/token")
    print(f"  latency {_latency_text(prefill.latency_coeffs)}")
    print(f"decode step time ({'one forward per request' if args.unbatched else 'batched'})")
    for b, seconds in steps:
        print(f"  batch {b:>4}  {seconds * 1000:9.2f} ms  ({1 / seconds:7.1f} tokens/s per request)")
    print(f"  batch {largest:>4}  {wide_s * 1000:9.2f} ms at {args.decode_context} tokens a row "
          f"(the above at {DECODE_CONTEXT}): {slot_s * 1e9:.1f} ns per row and token of width")  # fmt: skip
    decode: DecodeProfile | None = None
    try:
        measured = DecodeProfile.from_steps(name, args.gpus_per_instance, steps, args.slo)
        decode = replace(measured, context=DECODE_CONTEXT, slot_s=slot_s)
    except ValueError as e:
        print(f"  no [decode] table written: {e}")
    else:
        print(f"  {_bs_max_text(decode, steps, args.slo)}")
    save_profiles(args.out, prefill, decode)
    print(f"wrote {args.out}")
    return 0


def _latency_text(coeffs: tuple[float, ...]) -> str:
    if not coeffs:
        return "T(l): piecewise-linear through the points above, extended linearly past them"
    terms = [f"{c:.4g}" + ("" if i == 0 else " l" if i == 1 else f" l^{i}") for i, c in enumerate(coeffs)]
    return f"T(l) = {' + '.join(terms)} s (least squares)"


def _bs_max_text(decode: DecodeProfile, steps: list[tuple[int, float]], slo: float) -> str:
    """What BS_max rests on: the first batch measured that misses the SLO, or none (then it is a lower bound)."""
    step = f"step {decode.step_time_s * 1000:.2f} ms"
    missed = next(((b, s) for b, s in steps if b > decode.bs_max), None)
    if missed is None:
        return (
            f"BS_max {decode.bs_max} ({step}): the largest batch measured, and it still meets {slo:g} tokens/s, "
            "so the real limit is higher; time larger batches (--batches) to find it"
        )
    return (
        f"BS_max {decode.bs_max} ({step}): the largest batch meeting {slo:g} tokens/s "
        f"({1000 / slo:.1f} ms a step); batch {missed[0]} took {missed[1] * 1000:.2f} ms"
    )


def _latency_model(points: tuple[ProfilePoint, ...]) -> tuple[float, ...]:
    """Coefficients of T_prefill(l), or () to interpolate the points. When noisy timings allow neither without
    going below zero, a least-squares line that never does."""
    if len(points) > 2 and _valid(points, fit_latency(points)):
        return fit_latency(points)
    if _valid(points, ()):
        return ()
    x = np.array([p.tokens for p in points], dtype=float)
    y = np.array([p.latency_s for p in points])
    intercept, slope = np.polynomial.polynomial.polyfit(x, y, 1)
    if intercept < 0 or slope <= 0:  # through the origin instead
        intercept, slope = 0.0, float(x @ y / (x @ x))
    return (float(intercept), float(slope))


def _valid(points: tuple[ProfilePoint, ...], coeffs: tuple[float, ...]) -> bool:
    try:
        PrefillProfile("probe", 1, points, coeffs, 0.0, 1.0)
    except ValueError:
        return False
    return True
