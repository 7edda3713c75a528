"""What a decode worker runs: a Decoder steps every request it holds by one token at a time.

``BatchDecoder`` runs the requests as rows of one forward; ``InterleavedDecoder``, the unbatched reference, runs
one forward each. Both are synchronous: the caller decides which thread steps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from minifaas.model.layer_state import ModelState
from minifaas.model.sampling import SamplingParams

MAX_HOLD_S = 0.05  # the longest a step waits for more rows (``hold``)


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """0 for ``max_batch`` or ``step_token_budget``: what the worker's memory holds (``decode_memory.sized``)."""

    max_batch: int = 0  # rows in one forward; 1 selects the unbatched InterleavedDecoder
    step_token_budget: int = 0  # KV slots one step may attend to, padding included: rows x (longest + 1)
    max_waiting: int = 4096  # requests whose state has arrived, queued for a row
    hold: float = 0.0  # a decode worker's step waits this many times the last one's length while more come

    def __post_init__(self) -> None:
        if self.max_batch < 0 or self.step_token_budget < 0 or self.max_waiting < 0 or self.hold < 0:
            raise ValueError("need max_batch, step_token_budget (0: sized by memory), max_waiting and hold >= 0")

    @property
    def batched(self) -> bool:
        return self.max_batch != 1


@dataclass(frozen=True, slots=True)
class StepToken:
    request: str
    token: int
    finish: str | None  # "stop" | "length" on a request's last token


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: the request is refused, not kept waiting."""


class Decoder(Protocol):
    def submit(self, request: str, state: ModelState, next_token: int, sampling: SamplingParams) -> None:
        """Take a request whose state holds ``state.seq_len`` tokens and whose next token is ``next_token``."""
        ...

    def abort(self, request: str) -> bool:
        """Drop the request and free its state now; False if it was not here."""
        ...

    def step(self) -> list[StepToken]:
        """One more token for every running request; finished ones leave."""
        ...

    @property
    def load(self) -> int:
        """Requests held, running or waiting."""
        ...
