"""The exactness reference: transformers' own generate(), its stop rules as the runtime's, exact on the CPU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from minifaas.model.host_copy import build_cache
from minifaas.model.interleaved_decoder import forward_one, generate
from minifaas.model.loader import DEFAULT_MODEL, preset_names
from minifaas.model.reference import ReferenceRun, reference_run, reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

PROMPT = [(13 * i + 5) % 256 for i in range(120)]


@dataclass(frozen=True, slots=True)
class Divergence:
    index: int  # the first token that differs from the reference
    gap: float  # the reference's top logit minus its logit of the token the path chose, over the top |logit|


def divergence(tokens: Sequence[int], reference: ReferenceRun) -> Divergence | None:
    """Where ``tokens`` first leave the reference (None: they are the reference's, the same length)."""
    for i, (got, want) in enumerate(zip(tokens, reference.tokens)):
        if got != want:
            step = reference.logits[i]
            return Divergence(i, float((step[want] - step[got]) / step.abs().max()))
    if len(tokens) != len(reference.tokens):
        return Divergence(min(len(tokens), len(reference.tokens)), float("inf"))
    return None


@pytest.fixture(scope="module", params=[*preset_names(), DEFAULT_MODEL])
def runtime(request: pytest.FixtureRequest) -> ModelRuntime:
    return ModelRuntime.load(request.param)


def test_on_the_cpu_in_float32_every_logit_equals_the_runtimes_bit_for_bit(runtime: ModelRuntime) -> None:
    """Prefill, then a cache rebuilt from the exported state fed one token at a time: the same logits at every
    step as transformers' generate() with its own cache, so token equality elsewhere is exact, not lucky."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    reference = reference_run(runtime, PROMPT, params)
    result = runtime.prefill(PROMPT)
    cache = build_cache(runtime.config, result.state.layers, runtime.device)
    logits, tokens = [result.logits], [result.next_token]
    while len(tokens) < params.max_tokens:
        logits.append(forward_one(runtime, cache, tokens[-1]))
        tokens.append(int(logits[-1].argmax()))
    assert tokens == reference.tokens
    assert torch.equal(torch.stack(logits), reference.logits)


def test_stop_tokens_min_tokens_and_the_end_token_stop_it_as_they_stop_the_runtime() -> None:
    rt = ModelRuntime.load(DEFAULT_MODEL)  # trained: its text has newlines where the presets' noise has none
    ids = rt.tokenizer.encode("ROMEO:\nWhat light through yonder window breaks?\n")
    newline = rt.tokenizer.encode("\n")[-1]
    cases = [
        SamplingParams(max_tokens=60, stop_token_ids=(newline,)),
        SamplingParams(max_tokens=60, min_tokens=30, stop_token_ids=(newline,)),
        SamplingParams(max_tokens=40),
    ]
    for params in cases:
        expected = generate(rt, ids, params)
        assert reference_tokens(rt, ids, params) == expected, params
    first_line = reference_tokens(rt, ids, cases[0])
    assert first_line[-1] == newline and len(first_line) < 60
    assert len(reference_tokens(rt, ids, cases[1])) > 30


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.7, seed=1), SamplingParams(presence_penalty=0.5), SamplingParams(stop=("x",))],
    ids=["temperature", "penalty", "stop string"],
)
def test_what_transformers_cannot_honour_is_refused(params: SamplingParams) -> None:
    rt = ModelRuntime.load("qwen3-tiny")
    with pytest.raises(ValueError, match="greedy decoding with stop tokens only"):
        reference_tokens(rt, [1, 2, 3], params)


def test_divergence_is_the_first_token_that_differs_and_the_gap_there() -> None:
    logits = torch.tensor([[0.0, 4.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 8.0]])
    reference = ReferenceRun([1, 0, 2], logits)
    assert divergence([1, 0, 2], reference) is None
    first = divergence([1, 2, 0], reference)
    assert first is not None and (first.index, first.gap) == (1, pytest.approx(0.5))  # (2 - 1) / max |logit| 2
    short = divergence([1, 0], reference)
    assert short is not None and short.index == 2 and short.gap == float("inf")
