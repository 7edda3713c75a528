"""One decode worker's batch while a trace's requests of mixed lengths join and leave it.

The decoder a decode worker runs (``BatchDecoder``, one torch thread) is fed the slice of a shipped trace that
``bench_sim_fidelity`` replays (its first ``--requests`` requests, lengths scaled as it scales them), arriving at
the trace's own times sped up ``--speed`` times, on a clock that moves by each step's own time: a pace above what
the decoder holds piles rows up, as a loaded decode worker's do. Each request's state is a slice of one long
prefill, so no prefill is timed. Prints tokens/s, the steps, the most rows at once and the seconds spent in the
batch's buffer copies (``batch_cache.fitted``) of each of ``--repeats`` runs, and their median: once rows pile
up, a run's copies grow with them, so runs differ.

    python benchmarks/bench_decode_churn.py
    python benchmarks/bench_decode_churn.py --trace mooncake --speed 8 --json

``--quick`` is the smoke run the tests make: 60 requests, one repeat; the same code path.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from bench_sim_fidelity import TRACES, trace_slice  # the slice the fidelity benchmark replays, scaled alike

import minifaas.model.batch_cache as batch_cache
from minifaas.commands.arguments import positive, positive_int
from minifaas.model.batch_decoder import BatchDecoder
from minifaas.model.decoder import DecoderConfig
from minifaas.model.layer_state import ModelState, StateKind
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams


class CopyClock:
    """Seconds spent in ``batch_cache.fitted`` calls that copied a buffer, how many there were, and the slowest
    one (MiB, seconds)."""

    def __init__(self) -> None:
        self.seconds, self.copies, self.inner = 0.0, 0, batch_cache.fitted
        self.slowest = (0.0, 0.0)

    def __call__(self, buffer: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        started = time.perf_counter()
        out = self.inner(buffer, *args, **kwargs)
        if out is not buffer:
            took = time.perf_counter() - started
            self.seconds += took
            self.copies += 1
            self.slowest = max(self.slowest, (took, out.numel() * out.element_size() / 2**20))
        return out


def run_once(
    runtime: ModelRuntime, whole: ModelState, at: np.ndarray, prompts: np.ndarray, outputs: np.ndarray
) -> dict:
    """Decode every request, each joining at its arrival on the steps' own clock."""
    clock = CopyClock()
    batch_cache.fitted = clock
    try:
        decoder = BatchDecoder(runtime, DecoderConfig())
        now, nxt, steps, tokens, most = 0.0, 0, 0, 0, 0
        started = time.perf_counter()
        while nxt < len(prompts) or decoder.load:
            while nxt < len(prompts) and at[nxt] <= now:
                n = int(prompts[nxt])
                layers = [s.slice_tokens(0, n) if s.kind is StateKind.FULL_ATTENTION else s for s in whole.layers]
                params = SamplingParams(max_tokens=max(int(outputs[nxt]), 2), ignore_eos=True)
                decoder.submit(f"r{nxt}", ModelState(layers, n), 7, params)
                nxt += 1
            if not decoder.load:
                now = at[nxt]
                continue
            step_started = time.perf_counter()
            tokens += len(decoder.step())
            now += time.perf_counter() - step_started
            steps += 1
            most = max(most, len(decoder.running))
        wall = time.perf_counter() - started
    finally:
        batch_cache.fitted = clock.inner
    return {"tok_s": tokens / wall, "tokens": tokens, "steps": steps, "most_rows": most, "wall_s": wall,
            "copy_s": clock.seconds, "copies": clock.copies, "slowest_copy_s": clock.slowest[0],
            "slowest_copy_mib": clock.slowest[1]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", choices=TRACES, default="azure")
    p.add_argument("--requests", type=positive_int, default=400)
    p.add_argument("--speed", type=positive, default=32.0, help="the trace's arrivals this many times faster")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--quick", action="store_true", help="a smoke run: 60 requests, one repeat")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    a = p.parse_args()
    if a.quick:
        a.requests, a.repeats = min(a.requests, 60), 1
    torch.set_num_threads(1)  # as a decode worker on a 2-core box
    sl = trace_slice(a.trace, a.requests)
    prompts, outputs, at = sl.prompts, sl.output_tokens, sl.at_s / a.speed
    runtime = ModelRuntime.load()
    whole = runtime.prefill([(13 * i + 5) % 256 for i in range(int(prompts.max()))], chunk_tokens=512).state
    runs = [run_once(runtime, whole, at, prompts, outputs) for _ in range(a.repeats)]
    print(f"{a.trace}: {len(prompts)} requests over {at[-1]:.1f} s of the steps' clock ({a.speed:g}x the trace's "
          f"pace), prompts {int(np.median(prompts))} tokens median, {int(prompts.max())} at most")  # fmt: skip
    for r in runs:
        print(f"tok/s {r['tok_s']:6.0f}  steps {r['steps']:4d}  most rows {r['most_rows']:3d}  "
              f"buffer copies {r['copies']:3d} taking {r['copy_s']:5.2f} s of {r['wall_s']:5.2f} s, the slowest "
              f"{r['slowest_copy_s']:.3f} s ({r['slowest_copy_mib']:.0f} MiB)")  # fmt: skip
    median = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    print(f"median run: {median['tok_s']:.0f} tok/s, {median['copy_s']:.2f} s in buffer copies")
    if a.json:
        print(json.dumps({"bench": "decode_churn", "trace": a.trace, "speed": a.speed, "requests": len(prompts),
                          "median": median, "runs": runs}))  # fmt: skip


if __name__ == "__main__":
    main()
