"""Sampling parameters (vLLM-like) and a sampler that gives the same token on any worker.

The token at position ``pos`` is drawn with a generator seeded by ``(seed, pos)``, so a prefill worker's first
token and a decode worker's rest follow exactly what one process would draw. ``min_tokens`` and the presence and
frequency penalties also read the request's output so far (``History``), which the first token does not have.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties is [-2, 2]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # sample among the k most likely tokens only (0: all)
    min_tokens: int = 0  # no end-of-sequence or stop token (nor stop string) before this many tokens
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted once per time it was generated
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    resolved_seed: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be in [0, 2**31) (0: off), got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        object.__setattr__(self, "resolved_seed", self.seed if self.seed is not None else secrets.randbits(62))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain(self) -> bool:
        """Greedy with nothing that depends on the output so far: one argmax for a whole batch."""
        return self.greedy and not self.penalised and self.min_tokens == 0


GREEDY = SamplingParams()


class History:
    """A request's output tokens so far, as the sampler needs them: how many, and how often each (penalties)."""

    def __init__(self, params: SamplingParams, tokens: tuple[int, ...] = ()) -> None:
        self.length = 0
        self._penalised = params.penalised
        self._counts: torch.Tensor | None = None  # [vocab], made at the first penalised draw
        self._uncounted: list[int] = []
        for token in tokens:
            self.add(token)

    def add(self, token: int) -> None:
        self.length += 1
        if self._penalised:
            self._uncounted.append(token)

    def counts(self, vocab_size: int) -> torch.Tensor | None:
        """How often each token was generated, shape [vocab_size]; None when no penalty needs it."""
        if not self._penalised:
            return None
        if self._counts is None:
            self._counts = torch.zeros(vocab_size)
        for token in self._uncounted:
            self._counts[token] += 1
        self._uncounted.clear()
        return self._counts


def adjusted(
    logits: torch.Tensor, params: SamplingParams, history: History | None, stop_ids: tuple[int, ...]
) -> torch.Tensor:
    """``logits`` after min_tokens (``stop_ids`` banned while the output is shorter) and the penalties."""
    generated = history.length if history is not None else 0
    banned = generated < params.min_tokens and stop_ids
    counts = history.counts(logits.shape[-1]) if history is not None and generated else None
    if not banned and counts is None:
        return logits
    logits = logits.float().clone()
    if banned:
        logits[list(stop_ids)] = -float("inf")
    if counts is not None:
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def sample(
    logits: torch.Tensor, params: SamplingParams, position: int, history: History | None = None,
    eos_token_id: int | None = None,
) -> int:  # fmt: skip
    """One token from ``logits`` of shape [vocab], for the token at absolute ``position`` after ``history``."""
    stop_ids = params.stop_token_ids + ((eos_token_id,) if eos_token_id is not None and not params.ignore_eos else ())
    logits = adjusted(logits, params, history, stop_ids)
    if params.greedy:
        return int(torch.argmax(logits))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    logits = logits.float()
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)  # from <= 0: no overflow
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    gen = torch.Generator(device="cpu").manual_seed((params.resolved_seed * 1_000_003 + position) % 2**63)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int], histories: list[History],
    eos_token_id: int | None = None,
) -> list[int]:  # fmt: skip
    """Row i of ``logits`` [rows, vocab] sampled with params[i] at positions[i] after histories[i]."""
    if all(p.plain for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    rows = zip(params, positions, histories)
    return [sample(logits[i], p, pos, h, eos_token_id) for i, (p, pos, h) in enumerate(rows)]
