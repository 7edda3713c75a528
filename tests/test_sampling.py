"""The sampler: top_k, min_tokens and the penalties, alone and in both decoders, the same on every worker."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import torch

from minifaas.control.worker_ops import Sampling
from minifaas.model.batch_decoder import BatchDecoder
from minifaas.model.decoder import DecoderConfig
from minifaas.model.interleaved_decoder import InterleavedDecoder, generate
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import History, SamplingParams, sample

EOS = 7


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ModelRuntime.load("kimi-linear-tiny")
    torch.set_num_threads(threads)


def test_min_tokens_keeps_end_of_sequence_and_stop_tokens_out_until_enough_tokens() -> None:
    logits = torch.zeros(10)
    logits[EOS], logits[3], logits[5] = 9.0, 8.0, 1.0
    p = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(3,))
    history = History(p)
    assert sample(logits, p, 0, history, EOS) == 5  # EOS and the stop token are banned
    history.add(5)
    assert sample(logits, p, 1, history, EOS) == 5
    history.add(5)
    assert sample(logits, p, 2, history, EOS) == EOS  # two tokens out: they may end it now
    ignoring = SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True)
    assert sample(logits, ignoring, 0, History(ignoring), EOS) == EOS  # EOS is no stop: not banned


def test_a_temperature_near_zero_draws_the_most_likely_token_rather_than_failing() -> None:
    """Logits over a temperature of 1e-40 overflow float32; scaled from their maximum, they draw its token."""
    logits = torch.tensor([5.0, 9.0, -3.0, 8.5, -float("inf")])
    for temperature in (1e-40, 1e-30, 1e-6):
        for seed in range(20):
            assert sample(logits, SamplingParams(temperature=temperature, seed=seed), 0) == 1
    assert {sample(logits, SamplingParams(temperature=100.0, seed=s), 0) for s in range(400)} == {0, 1, 2, 3}


def test_penalties_lower_what_was_generated_by_presence_and_by_count() -> None:
    logits = torch.tensor([5.0, 4.5, 4.0, 0.0])
    presence = SamplingParams(presence_penalty=1.0)
    assert sample(logits, presence, 0, History(presence, (0,))) == 1  # 5 - 1 < 4.5
    frequency = SamplingParams(frequency_penalty=0.4)
    assert sample(logits, frequency, 0, History(frequency, (0,))) == 0  # 5 - 0.4 > 4.5
    assert sample(logits, frequency, 0, History(frequency, (0, 0))) == 1  # 5 - 0.8 < 4.5
    assert sample(logits, frequency, 0, History(frequency, (0, 0, 0, 1, 1))) == 2  # 3.8, 3.7, 4.0
    negative = SamplingParams(presence_penalty=-2.0)
    assert sample(logits, negative, 0, History(negative, (2,))) == 2  # a negative penalty favours repeats


def test_top_k_samples_only_among_the_k_most_likely() -> None:
    logits = torch.tensor([3.0, 2.9, 2.8, 0.5, 0.4, 0.3])
    drawn = {sample(logits, SamplingParams(temperature=5.0, top_k=2, seed=s), 0) for s in range(200)}
    assert drawn == {0, 1}
    everything = {sample(logits, SamplingParams(temperature=5.0, seed=s), 0) for s in range(200)}
    assert everything == set(range(6))
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1, seed=3), 0) == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", -1),
        ("top_k", 2**31),
        ("min_tokens", 17),
        ("min_tokens", -1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
    ],
)
def test_out_of_range_values_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})


def test_the_new_fields_cross_the_control_channel() -> None:
    p = SamplingParams(max_tokens=9, top_k=5, min_tokens=3, presence_penalty=0.5, frequency_penalty=-0.25, seed=4)
    assert Sampling.of(p).params() == p


def test_the_widest_params_allowed_pass_the_control_channel_bounds() -> None:
    """What SamplingParams accepts, a worker accepts too: else the worker refuses a request the API let in."""
    p = SamplingParams(
        max_tokens=2**31 - 1,
        temperature=100.0,
        top_k=2**31 - 1,
        min_tokens=2**31 - 1,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        seed=2**63 - 1,
        stop_token_ids=(2**31 - 1,),
    )
    assert msgspec.convert(msgspec.to_builtins(Sampling.of(p)), Sampling).params() == p


def drive(decoder: BatchDecoder | InterleavedDecoder, arrivals: list[tuple]) -> dict[str, list[int]]:
    for args in arrivals:
        decoder.submit(*args)
    out: dict[str, list[int]] = {}
    while decoder.load:
        for t in decoder.step():
            out.setdefault(t.request, []).append(t.token)
    return out


def test_both_decoders_and_generate_apply_them_alike(runtime: ModelRuntime) -> None:
    prompt = [(11 * i + 3) % 256 for i in range(30)]
    odd = tuple(range(1, 256, 2))
    params = {
        "greedy": SamplingParams(max_tokens=12, ignore_eos=True),
        "presence": SamplingParams(max_tokens=12, presence_penalty=-2.0, ignore_eos=True),  # favours repeats
        "frequency": SamplingParams(max_tokens=12, frequency_penalty=1.5, temperature=0.8, seed=5, ignore_eos=True),
        "top_k": SamplingParams(max_tokens=12, top_k=1, temperature=1.5, seed=6, ignore_eos=True),
        "min_tokens": SamplingParams(max_tokens=12, min_tokens=6, stop_token_ids=odd, ignore_eos=True),
    }
    alone = {name: generate(runtime, prompt, p) for name, p in params.items()}
    arrivals = []
    for name, p in params.items():
        first = runtime.prefill(prompt, sampling=p)
        arrivals.append((name, first.state, first.next_token, p))
    for decoder in (InterleavedDecoder(runtime), BatchDecoder(runtime, DecoderConfig(max_batch=8))):
        tokens = drive(decoder, arrivals)
        assert {name: [a[2], *tokens[name]] for name, a in zip(params, arrivals)} == alone
    assert alone["top_k"] == alone["greedy"]  # one candidate left: sampling is greedy
    repeats = {name: len(t) - len(set(t)) for name, t in alone.items()}
    assert repeats["presence"] > repeats["greedy"], alone  # the penalty is applied, not ignored
    stopped = alone["min_tokens"]
    assert len(stopped) >= 6 and all(t % 2 == 0 for t in stopped[:5]) and stopped[-1] % 2 == 1
