"""``minifaas profile`` on the tiny model: a profile file the planner and the simulator read back."""

from __future__ import annotations

import pytest

from minifaas.commands.main import main
from minifaas.commands.profile_model import _bs_max_text, _latency_model, _latency_text, measure_decode
from minifaas.commands.sim import with_profiles
from minifaas.model.batch_decoder import BatchDecoder, make_decoder
from minifaas.model.decoder import DecoderConfig
from minifaas.model.interleaved_decoder import InterleavedDecoder
from minifaas.planner.paper import paper_case
from minifaas.planner.profile import DecodeProfile, PrefillProfile, ProfilePoint, load_profiles
from minifaas.planner.search import best_prfaas


def test_profile_writes_what_the_planner_reads(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cpu.json"
    argv = ["profile", "--model", "kimi-linear-tiny", "--lengths", "16,64,128", "--batches", "1,2"]
    assert main([*argv, "--repeats", "1", "--decode-steps", "2", "--slo", "0.001", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "()" not in printed  # the latency model is written out, not an empty tuple
    assert "the largest batch measured, and it still meets 0.001 tokens/s" in printed  # BS_max is a lower bound

    prefill, decode = load_profiles(out)
    assert prefill is not None and decode is not None
    assert [p.tokens for p in prefill.points] == [16, 64, 128]
    sizes = [p.kv_bytes for p in prefill.points]
    assert sizes[0] < sizes[1] < sizes[2], "the state grows with the prompt (full-attention KV)"
    assert prefill.kv_bytes_per_token > 0 and prefill.kv_fixed_bytes > 0  # hybrid: a fixed recurrent state too
    assert decode.bs_max == 2 and decode.step_time_s < 1.0  # the step measured at batch 2, not 1/SLO = 1000 s
    assert f"step {decode.step_time_s * 1000:.2f} ms" in printed
    assert decode.context == 64 and decode.slot_s >= 0  # the largest batch timed again with 1,024-token rows
    assert "at 1024 tokens a row (the above at 64)" in printed
    with pytest.raises(SystemExit) as bad:  # no longer than the rows the steps were timed with
        main([*argv, "--decode-context", "64", "--out", str(out)])
    assert bad.value.code == 2 and "--decode-context must be more than" in capsys.readouterr().err

    case = with_profiles(paper_case(), None, str(out))
    assert case.pd_prefill == prefill and case.decode == decode and case.prfaas == paper_case().prfaas
    assert best_prfaas(case).throughput_rps > 0


def test_bs_max_says_which_measured_batch_missed_the_slo() -> None:
    steps = [(1, 0.01), (4, 0.02), (16, 0.05)]
    decode = DecodeProfile.from_steps("cpu", 1, steps, slo_tokens_per_s=40)
    assert (decode.bs_max, decode.step_time_s) == (4, 0.02)
    text = _bs_max_text(decode, steps, 40)
    assert "the largest batch meeting 40 tokens/s (25.0 ms a step); batch 16 took 50.00 ms" in text
    assert "T(l) = 0.1 + 0.002 l + 3e-06 l^2 s" in _latency_text((0.1, 0.002, 3e-6))
    assert "piecewise-linear" in _latency_text(())


def test_decode_is_timed_on_the_decoder_a_worker_runs() -> None:
    from minifaas.model.runtime import ModelRuntime

    runtime = ModelRuntime.load("kimi-linear-tiny")
    for batched in (True, False):
        steps = measure_decode(runtime, [1, 3], 2, batched)
        assert [b for b, _ in steps] == [1, 3] and all(s > 0 for _, s in steps)
    assert isinstance(make_decoder(runtime, DecoderConfig(max_batch=3)), BatchDecoder)
    assert isinstance(make_decoder(runtime, DecoderConfig(max_batch=1)), InterleavedDecoder)


def test_noisy_timings_still_give_a_latency_model_that_stays_positive() -> None:
    # a steep first segment: interpolating would cross zero below 64 tokens
    points = (ProfilePoint(64, 0.05, 1.0), ProfilePoint(512, 0.9, 2.0))
    with pytest.raises(ValueError, match="positive"):
        PrefillProfile("interpolated", 1, points)
    coeffs = _latency_model(points)
    profile = PrefillProfile("fitted", 1, points, coeffs)
    assert coeffs and float(profile.latency_s(1.0)) > 0 and float(profile.latency_s(512.0)) > 0.5
    # well-behaved points keep the plain interpolation
    assert _latency_model((ProfilePoint(64, 0.1, 1.0), ProfilePoint(512, 0.5, 2.0))) == ()
