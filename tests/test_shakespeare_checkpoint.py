"""The shipped checkpoint writes text: sampled continuations are the training text's words, and varied.

A vocabulary is built from the training text itself; at temperature 0.8 and a
few seeds, a few hundred bytes from a fixed prompt must be mostly its words,
must not loop (word 4-grams mostly distinct) and must differ between seeds.
"""

from __future__ import annotations

import re

import pytest
import torch

from minifaas.model.interleaved_decoder import generate
from minifaas.model.loader import DEFAULT_MODEL, MODELS_DIR, ModelSpec, checkpoint_names
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

TEXT = MODELS_DIR.parent / "data" / "text" / "tinyshakespeare.txt"
PROMPT = "KING HENRY:\nNow, lords, "
SEEDS = (1, 2, 3)
WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


@pytest.fixture(scope="module")
def samples() -> dict[int, str]:
    rt = ModelRuntime.load(DEFAULT_MODEL)
    ids = rt.tokenizer.encode(PROMPT)
    return {
        seed: rt.tokenizer.decode(generate(rt, ids, SamplingParams(max_tokens=200, temperature=0.8, seed=seed)))
        for seed in SEEDS
    }


def test_the_default_model_is_the_shipped_checkpoint() -> None:
    assert DEFAULT_MODEL in checkpoint_names()
    spec = ModelSpec.resolve(DEFAULT_MODEL)
    assert spec.kind == "checkpoint" and spec.directory == MODELS_DIR / "checkpoints" / DEFAULT_MODEL


def known_words(text: str) -> tuple[int, float]:
    """How many words ``text`` has (the last, which max_tokens may cut, left out), and the share of them that the
    training text has: random bytes, or a model whose weights went wrong, make few of them."""
    vocabulary = set(words(TEXT.read_text()))
    found = words(text)[:-1]
    return len(found), sum(w in vocabulary for w in found) / max(1, len(found))


def test_it_loads_in_bfloat16_and_still_writes_words_of_the_training_text() -> None:
    rt = ModelRuntime.load(DEFAULT_MODEL, dtype=torch.bfloat16)
    assert rt.model.dtype == torch.bfloat16
    text = rt.tokenizer.decode(generate(rt, rt.tokenizer.encode(PROMPT), SamplingParams(max_tokens=120, seed=1)))
    count, known = known_words(text)
    assert count >= 12 and known >= 0.8, (count, known, text)


def test_random_bytes_fail_the_known_vocabulary_check() -> None:
    noise = bytes(torch.randint(32, 127, (400,), generator=torch.Generator().manual_seed(0)).tolist()).decode()
    count, known = known_words(noise)
    assert count >= 12 and known < 0.5, (count, known)


@pytest.mark.slow
def test_samples_are_words_of_the_training_text(samples: dict[int, str]) -> None:
    for seed, text in samples.items():
        count, known = known_words(text)
        assert count >= 20 and known >= 0.8, (seed, count, known, text)


@pytest.mark.slow
def test_samples_do_not_loop_and_differ_by_seed(samples: dict[int, str]) -> None:
    for seed, text in samples.items():
        found = words(text)
        grams = [tuple(found[i : i + 4]) for i in range(len(found) - 3)]
        assert len(set(grams)) / len(grams) >= 0.9, (seed, text)
    assert len(set(samples.values())) == len(SEEDS)
