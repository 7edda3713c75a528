"""Continuous batching: every running request is a row of one forward per step, one per ``Lane`` of like lengths.

A request joins as soon as its state has arrived and a row is free, and leaves when it finishes or is aborted.
Each row samples with its own parameters at its own position, so it draws what it would draw decoded alone.
Admission is in arrival order, bounded by ``max_batch`` rows and a step's KV budget (padding included; a lone row
always runs); running rows are never preempted, and a request past ``max_waiting`` is refused with QueueFull.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from minifaas.model.batch_cache import BatchCache
from minifaas.model.decode_memory import sized_for
from minifaas.model.decoder import Decoder, DecoderConfig, QueueFull, StepToken
from minifaas.model.family_rows import row_layer
from minifaas.model.interleaved_decoder import InterleavedDecoder
from minifaas.model.layer_state import ModelState
from minifaas.model.runtime import ModelRuntime, decode_finish
from minifaas.model.sampling import History, SamplingParams, sample_batch

log = logging.getLogger("minifaas.decode")
LANE_TOKENS = 4096
LANE_FACTOR = 8


def lane_of(tokens: int) -> int:
    """The length class of a row of ``tokens``: 0 under ``LANE_TOKENS``, then one more per ``LANE_FACTOR``."""
    lane, limit = 0, LANE_TOKENS
    while tokens >= limit:
        lane, limit = lane + 1, limit * LANE_FACTOR
    return lane


@dataclass(slots=True)
class Row:
    request: str
    sampling: SamplingParams
    position: int  # absolute position of the newest token, the one the next step feeds
    history: History  # what the sampler needs of the tokens so far
    tokens: list[int] = field(default_factory=list)
    state: ModelState | None = None  # held while waiting, dropped once copied into the batch


class Lane:
    def __init__(self, runtime: ModelRuntime) -> None:
        self.runtime = runtime
        self.cache = BatchCache(runtime.config, row_layer, runtime.device)
        self.running: list[Row] = []  # running[i] is row i of the cache

    def slots(self, joining: int | None = None) -> int:
        """KV slots a step attends to, padding included; with a row at position ``joining`` added."""
        lengths = [*self.cache.lengths, *([] if joining is None else [joining])]
        return len(lengths) * (max(lengths) + 1) if lengths else 0

    def add(self, row: Row) -> None:
        assert row.state is not None
        self.cache.add_row(row.state.layers, row.state.seq_len)
        row.state = None
        self.running.append(row)

    def abort(self, request: str) -> bool:
        for index, row in enumerate(self.running):
            if row.request == request:
                self.release(index)
                return True
        return False

    def step(self) -> list[StepToken]:
        """One token for every row; finished rows leave."""
        logits = self._forward()
        self.cache.advance()
        for row in self.running:
            row.position += 1
        eos = self.runtime.eos_token_id
        params, positions = [r.sampling for r in self.running], [r.position for r in self.running]
        tokens = sample_batch(logits, params, positions, [r.history for r in self.running], eos)
        out, finished = [], []
        for index, (row, token) in enumerate(zip(self.running, tokens)):
            row.tokens.append(token)
            row.history.add(token)
            finish = decode_finish(self.runtime, row.sampling, token, len(row.tokens), row.position)
            out.append(StepToken(row.request, token, finish))
            if finish is not None:
                finished.append(index)
        for index in reversed(finished):  # highest first, so the row moved into a hole is never one still to go
            self.release(index)
        return out

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        """Logits [rows, vocab] of the token after each row's newest one."""
        device = self.runtime.device
        masks = self.cache.prepare_step(self.runtime.model.dtype)
        ids = torch.tensor([[r.tokens[-1]] for r in self.running], dtype=torch.long, device=device)
        positions = torch.tensor([[r.position] for r in self.running], dtype=torch.long, device=device)
        out = self.runtime.model(
            input_ids=ids, attention_mask=masks, position_ids=positions, cache=self.cache.cache, use_cache=True
        )
        return out.logits[:, -1].float().cpu()

    def release(self, index: int) -> None:
        moved = self.cache.remove_row(index)
        if moved is not None:
            self.running[index] = self.running[moved]
        self.running.pop()


class BatchDecoder:
    def __init__(self, runtime: ModelRuntime, config: DecoderConfig | None = None) -> None:
        self.runtime, self.config = runtime, sized_for(config or DecoderConfig(), runtime)
        self.lanes: dict[int, Lane] = {0: Lane(runtime)}  # by length class (``lane_of``); the first kept
        self.waiting: deque[Row] = deque()

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
        out = []
        for _, lane in sorted(self.lanes.items()):
            if lane.running:
                out += lane.step()
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
