"""A checkpoint directory served by `minifaas serve`: the official openai client, completions and chat.

The trained checkpoint is passed as a path, as a user passes their own; its
tokenizer is the checkpoint's (AutoTokenizer, chat template included). On both
routes a greedy answer equals transformers' own generate() on the same prompt
ids (``model.reference``), and one sampled with a seed equals the runtime's
one-process generate() (the seeded sampler is this project's own). Each request's prompt is its own from the
first byte: a prefix-cache hit continues from a cached state, whose arithmetic
differs from one forward's in the last bits, and a sampled token may follow.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from serve_child import serving

from minifaas.model.interleaved_decoder import generate
from minifaas.model.loader import DEFAULT_MODEL, MODELS_DIR
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

pytestmark = pytest.mark.slow  # a server of four processes, then a dozen requests
CHECKPOINT = MODELS_DIR / "checkpoints" / DEFAULT_MODEL
SHORT = "ROMEO:\nBut soft, what light"
LONG = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" * 5
CHAT = [{"role": "user", "content": "Who's there?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving("--model", str(CHECKPOINT), "--threshold", "300", "--link-rate", "50mbit") as (url, _):
        yield url


@pytest.fixture(scope="module")
def runtime() -> ModelRuntime:
    return ModelRuntime.load(str(CHECKPOINT))


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none")


def _expected(rt: ModelRuntime, ids: list[int], **sampling: object) -> str:
    """Greedy: transformers' own generate(); seeded: the runtime in one process (the sampler is ours alone)."""
    params = SamplingParams(max_tokens=12, **sampling)  # type: ignore[arg-type]
    return rt.tokenizer.decode(reference_tokens(rt, ids, params) if params.greedy else generate(rt, ids, params))


def test_the_model_is_named_after_its_directory(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [CHECKPOINT.name]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seed"])
def test_completions_on_both_routes_equal_generate(
    client: openai.OpenAI, runtime: ModelRuntime, sampling: dict
) -> None:
    for i, (text, route) in enumerate(((SHORT, "local"), (LONG, "prfaas"))):
        for stream in (False, True):
            prompt = f"{sampling.get('seed', 0)}.{i}.{stream:d} {text}"
            want = _expected(runtime, runtime.tokenizer.encode(prompt), **sampling)
            reply = client.completions.create(
                model=CHECKPOINT.name, prompt=prompt, max_tokens=12, stream=stream, **sampling
            )
            if stream:
                assert "".join(c.choices[0].text for c in reply if c.choices) == want
            else:
                assert reply.choices[0].text == want and reply.model_extra["minifaas"]["route"] == route


def test_chat_streamed_and_not_follows_the_chat_template(client: openai.OpenAI, runtime: ModelRuntime) -> None:
    for stream in (False, True):
        messages = [{"role": "system", "content": f"You are player {stream:d}."}, *CHAT]
        want = _expected(runtime, runtime.tokenizer.chat(messages), temperature=0.8, seed=11)
        reply = client.chat.completions.create(
            model=CHECKPOINT.name, messages=messages, max_tokens=12, temperature=0.8, seed=11, stream=stream
        )
        if stream:
            assert "".join(p.choices[0].delta.content or "" for p in reply if p.choices) == want
        else:
            assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == want
            assert reply.usage.prompt_tokens == len(runtime.tokenizer.chat(messages))
            assert reply.usage.completion_tokens == 12
