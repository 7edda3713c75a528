"""Prompts of one length prefilled as the rows of one forward, each row's layer states handed to its own callback.

A batch pays a forward's fixed cost once, and rows of one length need no padding, so a row's state is the one its
prompt alone would give. A row whose callback raises (its request was aborted) is dropped; the others go on.
A ``PrefillBatch`` is such a batch being served: its members join as their transfers open (or leave), and its
leader runs the forward once every member is in or out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from minifaas.model.layer_state import LayerState, ModelState, StateLayout, new_cache
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
    start, cache = time.perf_counter(), new_cache(runtime.config)
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
        for state in self.layout.extract(self.cache, index, self.length):
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


class RowSink(Protocol):
    def put_layer(self, layer: LayerState) -> None: ...


class Member(Protocol):
    """A prompt in a batch: its row's layers go to its ``sink`` once its transfer is open."""

    batch: PrefillBatch | None
    adopted: asyncio.Future[None] | None  # set when a batch ahead of it takes it along
    sink: RowSink | None

    @property
    def tokens(self) -> list[int]: ...

    @property
    def sampling(self) -> SamplingParams: ...


class PrefillBatch:
    def __init__(self, leader: Member, riders: list[Member], waiting: list[Member]) -> None:
        self.members = [leader, *riders]
        self.rows: list[Member] = []  # those that joined, each with its sink
        self._pending = set(range(len(self.members)))
        self._in = asyncio.Event()
        self._results: asyncio.Future[list[PrefillResult | Exception]] = asyncio.get_running_loop().create_future()
        self._results.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, whoever waited
        for member in self.members:
            member.batch = self
        for rider in riders:
            waiting.remove(rider)
            rider.adopted.set_result(None)  # type: ignore[union-attr]

    @property
    def leader(self) -> Member:
        return self.members[0]

    def join(self, member: Member) -> None:
        """``member``'s transfer is open: its row's layers go to its sink."""
        self.rows.append(member)
        self._gone(member)

    def leave(self, member: Member) -> None:
        """``member`` will not join (aborted, or its transfer failed to open)."""
        if not self._in.is_set():
            self._gone(member)

    def _gone(self, member: Member) -> None:
        self._pending.discard(next(i for i, m in enumerate(self.members) if m is member))
        if not self._pending:
            self._in.set()

    async def run(self, runtime: ModelRuntime) -> None:
        """Once every member has joined or left: the forward of the rows that joined, on the runtime's thread."""
        try:
            await self._in.wait()
            rows = list(self.rows)
            sinks = [m.sink.put_layer for m in rows if m.sink is not None]
            assert len(sinks) == len(rows), "a row joined before its transfer was open"
            prompts, samplings = [m.tokens for m in rows], [m.sampling for m in rows]
            results = await runtime.on_forward_thread(prefill_batch, runtime, prompts, sinks, samplings)
        except BaseException as e:
            self._results.set_exception(e if isinstance(e, Exception) else RuntimeError("the batch was cancelled"))
            raise
        self._results.set_result(results)

    async def outcome(self, member: Member) -> PrefillResult:
        """``member``'s row of the forward, or the exception that ended it."""
        results = await asyncio.shield(self._results)
        result = results[next(i for i, m in enumerate(self.rows) if m is member)]
        if isinstance(result, Exception):
            raise result
        return result
