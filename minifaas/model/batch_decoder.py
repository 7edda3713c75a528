"""Continuous batching: every running request is one row of a single forward pass per step.

A request joins as soon as its state has arrived and a row is free, and leaves the moment it finishes or is
aborted. Rows differ in context length (``batch_cache``), sampling parameters and seeds: each row samples with
its own parameters at its own absolute position, so it draws the tokens it would draw decoded alone.

Admission is in arrival order and bounded twice: at most ``max_batch`` rows, and a step may attend to at most
``step_token_budget`` KV slots, padding included (rows x (longest row + 1)); a lone row always runs. The head of
the queue waits until it fits; nothing behind it jumps ahead. The budget gates admission only: running rows are
never preempted. At most ``max_waiting`` requests wait; one more is refused with QueueFull. Prefills are not
batched: prefill workers take one prompt at a time.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from minifaas.model.batch_cache import BatchCache
from minifaas.model.decoder import Decoder, DecoderConfig, QueueFull, StepToken
from minifaas.model.interleaved_decoder import InterleavedDecoder
from minifaas.model.layer_state import ModelState
from minifaas.model.runtime import ModelRuntime, finish_reason
from minifaas.model.sampling import History, SamplingParams, sample_batch

log = logging.getLogger("minifaas.decode")


@dataclass(slots=True)
class Row:
    request: str
    sampling: SamplingParams
    position: int  # absolute position of the newest token, the one the next step feeds
    history: History  # what the sampler needs of the tokens so far
    tokens: list[int] = field(default_factory=list)
    state: ModelState | None = None  # held while waiting, dropped once copied into the batch


class BatchDecoder:
    def __init__(self, runtime: ModelRuntime, config: DecoderConfig | None = None) -> None:
        self.runtime, self.config = runtime, config or DecoderConfig()
        self.cache = BatchCache(runtime.config, runtime.device)
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []  # running[i] is row i of the cache
        self.last_logits: torch.Tensor | None = None  # [rows, vocab] of the last step, rows in its output's order

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

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
        for index, row in enumerate(self.running):
            if row.request == request:
                self._release(index)
                return True
        return False

    def step(self) -> list[StepToken]:
        self._admit()
        if not self.running:
            return []
        logits = self.last_logits = self._forward()
        self.cache.advance()
        positions = []
        for row in self.running:
            row.position += 1
            positions.append(row.position)
        histories = [r.history for r in self.running]
        tokens = sample_batch(
            logits, [r.sampling for r in self.running], positions, histories, self.runtime.eos_token_id
        )
        out, finished = [], []
        for index, (row, token) in enumerate(zip(self.running, tokens)):
            row.tokens.append(token)
            row.history.add(token)
            finish = finish_reason(self.runtime, row.sampling, token, len(row.tokens), row.position)
            out.append(StepToken(row.request, token, finish))
            if finish is not None:
                finished.append(index)
        for index in reversed(finished):  # highest first, so the row moved into a hole is never one still to go
            self._release(index)
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

    def _admit(self) -> None:
        budget = self.config.step_token_budget
        while self.waiting and len(self.running) < self.config.max_batch:
            head = self.waiting[0]
            width = max([head.position, *self.cache.lengths]) + 1
            if self.running and (len(self.running) + 1) * width > budget:
                break
            self.waiting.popleft()
            assert head.state is not None
            self.cache.add_row(head.state.layers, head.state.seq_len)
            head.state = None
            self.running.append(head)

    def _release(self, index: int) -> None:
        moved = self.cache.remove_row(index)
        if moved is not None:
            self.running[index] = self.running[moved]
        self.running.pop()


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
