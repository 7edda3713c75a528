"""Warm-up: run the shapes real requests will use before a worker says it is ready.

On a GPU the first forward of each new shape compiles and autotunes Triton kernels. A worker runs a prefill's
chunk shapes and a decode step at each power-of-two batch up to ``max_batch`` before it reports ready, so no
request's deadline pays for that; on the CPU it asks for tiny sizes (``cpu_plan``). The warm-up also records
which kernels the layers really run, for the gateway.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from minifaas.model.decoder import Decoder
from minifaas.model.kernels import KernelRecorder
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

TAIL_TOKENS = 7  # a last chunk shorter than the others


@dataclass(frozen=True, slots=True)
class WarmUpPlan:
    prefill_chunk: int  # the worker's --prefill-chunk (0: one forward per prompt)
    batch_sizes: tuple[int, ...]  # decode batches to step once each (empty: a prefill worker)

    def __post_init__(self) -> None:
        if self.prefill_chunk < 0 or any(b < 1 for b in self.batch_sizes):
            raise ValueError("need prefill_chunk >= 0 and batch sizes >= 1")

    @classmethod
    def for_worker(cls, prefill_chunk: int, max_batch: int | None) -> WarmUpPlan:
        batches: tuple[int, ...] = ()
        if max_batch:
            powers = [1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch]
            batches = tuple(sorted({*powers, max_batch}))
        return cls(prefill_chunk, batches)

    def cpu_plan(self) -> WarmUpPlan:
        """The same steps at sizes that cost nothing on the CPU."""
        return WarmUpPlan(min(self.prefill_chunk, 8), tuple(b for b in self.batch_sizes if b <= 2))

    def prompt_lengths(self) -> tuple[int, ...]:
        chunk = self.prefill_chunk or 64
        return (2 * chunk + TAIL_TOKENS, chunk + 1)


def warm_up(runtime: ModelRuntime, plan: WarmUpPlan, decoder: Decoder | None = None) -> dict:
    """Run ``plan`` (blocking: call it in a thread); what ran and how long it took, for the log."""
    started = time.perf_counter()
    states = []
    with recording_kernels(runtime):
        for n in plan.prompt_lengths():
            tokens = [(13 * i + 5) % 256 for i in range(min(n, runtime.max_context - 2))]
            states.append(runtime.prefill(tokens, chunk_tokens=plan.prefill_chunk))
        for size in plan.batch_sizes:
            if decoder is None:
                break
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            for row in range(size):
                first = states[row % len(states)]
                decoder.submit(f"warm-up-{size}-{row}", first.state, first.next_token, params)
            while decoder.load:  # two steps: the batch of ``size`` forms, then finishes
                decoder.step()
    return {"prompts": list(plan.prompt_lengths()), "batches": list(plan.batch_sizes),
            "seconds": round(time.perf_counter() - started, 3)}  # fmt: skip


@contextlib.contextmanager
def recording_kernels(runtime: ModelRuntime) -> Iterator[None]:
    """While open, note what each layer kind's kernel functions really call; ``runtime.kernels`` then says that."""
    layout = runtime.layout
    kinds = [
        "+".join(layout.parts[i].kind.name.lower() for i in layout.parts_of(layer)) or "stateless"
        for layer in range(runtime.num_layers)
    ]
    with KernelRecorder(runtime.model, kinds) as recorder:
        yield
    runtime.kernels = recorder.report(runtime.kernels)
