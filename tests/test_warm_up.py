"""Warm-up: the shapes a worker runs before it is ready, and the run itself (tiny sizes on the CPU)."""

from __future__ import annotations

import pytest

from minifaas.model.batch_decoder import make_decoder
from minifaas.model.decoder import DecoderConfig
from minifaas.model.runtime import ModelRuntime
from minifaas.model.warm_up import TAIL_TOKENS, WarmUpPlan, warm_up


def test_the_plan_covers_the_chunk_the_short_last_chunk_and_every_power_of_two_batch() -> None:
    plan = WarmUpPlan.for_worker(512, 24)
    assert plan.batch_sizes == (1, 2, 4, 8, 16, 24)
    assert plan.prompt_lengths() == (2 * 512 + TAIL_TOKENS, 513)  # full chunks, a short tail, a 1-token tail
    assert WarmUpPlan.for_worker(512, None).batch_sizes == ()  # a prefill worker decodes nothing
    cheap = plan.cpu_plan()
    assert cheap.prefill_chunk == 8 and cheap.batch_sizes == (1, 2)
    with pytest.raises(ValueError, match="batch sizes"):
        WarmUpPlan(16, (0,))


def test_warm_up_runs_prefill_and_every_decode_batch_and_leaves_the_decoder_empty() -> None:
    rt = ModelRuntime.load("qwen3.5-tiny")
    decoder = make_decoder(rt, DecoderConfig(max_batch=4))
    report = warm_up(rt, WarmUpPlan.for_worker(8, 4), decoder)
    assert report["batches"] == [1, 2, 4] and report["prompts"] == [23, 9]
    assert decoder.load == 0  # the warm-up rows all finished: the decoder starts empty
