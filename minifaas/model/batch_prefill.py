"""Prompts of one length prefilled as the rows of one forward, each row's layer states handed to its own callback.

A batch pays a forward's fixed cost once, and rows of one length need no padding, so a row's state is the one its
prompt alone would give. A row whose callback raises (its request was aborted) is dropped; the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minifaas.model.layer_state import LayerState, ModelState, StateLayout
from minifaas.model.runtime import ModelRuntime, OnLayer, PrefillResult
from minifaas.model.sampling import SamplingParams, sample


@torch.no_grad()
def prefill_batch(
    runtime: ModelRuntime,
    prompts: Sequence[Sequence[int]],
    on_layers: Sequence[OnLayer],
    samplings: Sequence[SamplingParams],
) -> list[PrefillResult | Exception]:
    """``prompts`` from an empty cache as one forward; per row its result, or the exception that dropped it.
    Raises when every row is dropped. Blocking: run it on the runtime's thread."""
    length = len(prompts[0])
    if not length or any(len(p) != length for p in prompts) or length > runtime.max_context:
        raise ValueError(f"a batched prefill needs prompts of one length within {runtime.max_context} tokens")
    start, cache = time.perf_counter(), runtime.new_cache()
    hook = _RowsHook(runtime.layout, cache, length, list(on_layers))
    layers = runtime.decoder_layers
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: hook(i)) for i, layer in enumerate(layers)]
    try:
        ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=runtime.device)
        logits = runtime.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    finally:
        for h in handles:
            h.remove()
    logits, seconds = logits.float().cpu(), time.perf_counter() - start
    out: list[PrefillResult | Exception] = []
    for row, (states, sampling) in enumerate(zip(hook.layers, samplings, strict=True)):
        if isinstance(states, Exception):
            out.append(states)
            continue
        token = sample(logits[row], sampling, length, eos_token_id=runtime.eos_token_id)
        out.append(PrefillResult(ModelState(states, length), token, logits[row], length, seconds))
    return out


@dataclass(slots=True)
class _RowsHook:
    layout: StateLayout
    cache: object
    length: int
    on_layers: list[OnLayer]
    layers: list[list[LayerState] | Exception] = field(default_factory=list)  # per row: its states, or why dropped

    def __post_init__(self) -> None:
        self.layers = [[] for _ in self.on_layers]

    def __call__(self, index: int) -> None:
        for state in self.layout.extract(self.cache, index, self.length, clone_fixed=False):
            for row, kept in enumerate(self.layers):
                if isinstance(kept, Exception):
                    continue
                mine = row_of(state, row)
                try:
                    self.on_layers[row](mine)
                except Exception as e:  # that row's request is gone; the others go on
                    self.layers[row] = e
                    continue
                kept.append(mine)
        if all(isinstance(kept, Exception) for kept in self.layers):
            raise next(kept for kept in self.layers if isinstance(kept, Exception))


def row_of(state: LayerState, row: int) -> LayerState:
    """Row ``row`` of a batched state (a view: no copy)."""
    return LayerState(state.layer, state.kind, state.seq_len, tuple((n, t[row : row + 1]) for n, t in state.slots))
