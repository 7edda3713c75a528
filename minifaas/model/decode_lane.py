"""One lane of a decode batch: rows of one length class, one padded cache, one forward per step.

Rows in a cache are padded to its longest (``batch_cache``), in memory and in attention. So ``BatchDecoder``
keeps a lane per length class (``lane_of``: contexts under ``LANE_TOKENS``, then each class up to
``LANE_FACTOR`` times longer): a 32K-token request pads only its own lane, and the short ones beside it never
pay its length. A row stays in the lane it joined; each lane with rows runs its own forward per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minifaas.model.batch_cache import BatchCache
from minifaas.model.decoder import StepToken
from minifaas.model.layer_state import ModelState
from minifaas.model.runtime import ModelRuntime, finish_reason
from minifaas.model.sampling import History, SamplingParams, sample_batch

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
        self.cache = BatchCache(runtime.config, runtime.device)
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

    def step(self) -> tuple[list[StepToken], torch.Tensor]:
        """One token for every row, and the logits [rows, vocab] it was drawn from; finished rows leave."""
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
            finish = finish_reason(self.runtime, row.sampling, token, len(row.tokens), row.position)
            out.append(StepToken(row.request, token, finish))
            if finish is not None:
                finished.append(index)
        for index in reversed(finished):  # highest first, so the row moved into a hole is never one still to go
            self.release(index)
        return out, logits

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
