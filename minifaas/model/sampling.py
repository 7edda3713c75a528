"""Sampling parameters (vLLM-like) and a sampler that gives the same token on any worker.

Randomness is stateless per position: the generator for the token at position
``pos`` is seeded with ``(seed, pos)``. So the first token, drawn on a prefill
worker, and the rest, drawn on a decode worker, follow exactly the sequence a
single process would produce, with nothing to hand over but the seed.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
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
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        object.__setattr__(self, "resolved_seed", self.seed if self.seed is not None else secrets.randbits(62))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """One token from ``logits`` of shape [vocab], for the token at absolute ``position``."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    gen = torch.Generator(device="cpu").manual_seed((params.resolved_seed * 1_000_003 + position) % 2**63)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """Row i of ``logits`` [rows, vocab] sampled with params[i] at positions[i]."""
    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    return [sample(logits[i], p, pos) for i, (p, pos) in enumerate(zip(params, positions))]
