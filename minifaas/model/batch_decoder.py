"""Continuous batching: every running request is a row of one forward per step, one per lane of like lengths.

A request joins as soon as its state has arrived and a row is free, and leaves the moment it finishes or is
aborted. Rows differ in context length (``batch_cache``), sampling parameters and seeds: each row samples with
its own parameters at its own absolute position, so it draws the tokens it would draw decoded alone.

Admission is in arrival order and bounded twice: at most ``max_batch`` rows, and a step may attend to at most
``step_token_budget`` KV slots, padding included (per lane, rows x (longest + 1)); a lone row always runs. The head of
the queue waits until it fits; nothing behind it jumps ahead. The budget gates admission only: running rows are
never preempted. At most ``max_waiting`` requests wait; one more is refused with QueueFull. Both bounds default
to what the worker's memory holds (``decode_memory``).
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from minifaas.model.batch_cache import BatchCache
from minifaas.model.decode_lane import Lane, Row, lane_of
from minifaas.model.decode_memory import sized_for
from minifaas.model.decoder import Decoder, DecoderConfig, QueueFull, StepToken
from minifaas.model.interleaved_decoder import InterleavedDecoder
from minifaas.model.layer_state import ModelState
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import History, SamplingParams

log = logging.getLogger("minifaas.decode")


class BatchDecoder:
    def __init__(self, runtime: ModelRuntime, config: DecoderConfig | None = None) -> None:
        self.runtime, self.config = runtime, sized_for(config or DecoderConfig(), runtime)
        self.lanes: dict[int, Lane] = {0: Lane(runtime)}  # by length class (``decode_lane``); the first kept
        self.waiting: deque[Row] = deque()
        self.last_logits: torch.Tensor | None = None  # [rows, vocab] of the last step, rows in its output's order

    @property
    def cache(self) -> BatchCache:
        """The first lane's: every row of a context under ``LANE_TOKENS``."""
        return self.lanes[0].cache

    @property
    def running(self) -> list[Row]:
        """Every lane's rows, shortest lane first: a step's order."""
        return [row for _, lane in sorted(self.lanes.items()) for row in lane.running]

    @property
    def load(self) -> int:
        return len(self.waiting) + sum(len(lane.running) for lane in self.lanes.values())

    def submit(self, request: str, state: ModelState, next_token: int, sampling: SamplingParams) -> None:
        if any(r.request == request for r in (*self.waiting, *self.running)):
            raise ValueError(f"request {request!r} is already decoding")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests already wait for a decode row")
        self.cache.check(state.layers)  # a bad state fails its own request here, not a later step of the batch
        history = History(sampling, (next_token,))
        self.waiting.append(Row(request, sampling, state.seq_len, history, [next_token], state))

    def abort(self, request: str) -> bool:
        for row in self.waiting:
            if row.request == request:
                self.waiting.remove(row)
                return True
        if any(lane.abort(request) for lane in self.lanes.values()):
            self._drop_empty()
            return True
        return False

    def step(self) -> list[StepToken]:
        self._admit()
        out, logits = [], []
        for _, lane in sorted(self.lanes.items()):
            if lane.running:
                tokens, lane_logits = lane.step()
                out += tokens
                logits.append(lane_logits)
        if logits:
            self.last_logits = torch.cat(logits)
        self._drop_empty()
        return out

    def _admit(self) -> None:
        budget = self.config.step_token_budget
        while self.waiting and len(self.running) < self.config.max_batch:
            head = self.waiting[0]
            lane = self.lanes.get(lane_of(head.position)) or Lane(self.runtime)
            others = sum(x.slots() for x in self.lanes.values() if x is not lane)
            if self.running and others + lane.slots(head.position) > budget:
                break
            self.waiting.popleft()
            lane.add(head)
            self.lanes[lane_of(head.position)] = lane

    def _drop_empty(self) -> None:
        """Let the buffers of a longer lane go once its last row has: they are as long as its longest was."""
        for k in [k for k, lane in self.lanes.items() if k and not lane.running]:
            del self.lanes[k]


def make_decoder(runtime: ModelRuntime, config: DecoderConfig) -> Decoder:
    """The decoder a decode worker runs for ``config``: batched, unless ``max_batch`` is 1 or the model's
    layers have no batched cache (then one forward per request, with a warning)."""
    if not config.batched:
        return InterleavedDecoder(runtime)
    try:
        return BatchDecoder(runtime, config)
    except NotImplementedError as e:
        log.warning("%s: decoding UNBATCHED, one forward per request (%s)", runtime.spec.name, e)
        return InterleavedDecoder(runtime)
