"""Warm-up: the shapes a worker runs before it is ready, and the run itself (tiny sizes on the CPU)."""

from __future__ import annotations

import pytest

from minifaas.model.batch_decoder import make_decoder
from minifaas.model.decoder import DecoderConfig
from minifaas.model.interleaved_decoder import generate
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


def test_warm_up_records_what_each_layer_kind_ran_and_puts_back_what_the_model_calls() -> None:
    """The kernel report a worker gives the gateway is what its warm-up ran: here (fla kept out) the torch
    reference of every kernel function, the short convolution's included, in the linear-attention layers."""
    rt = ModelRuntime.load("qwen3.5-tiny")
    assert rt.kernels.ran == ()  # nothing has run yet: the report is the bindings
    before = generate(rt, list(range(12)))
    warm_up(rt, WarmUpPlan(4, (1,)), make_decoder(rt, DecoderConfig(max_batch=2)))
    ran = rt.kernels.to_json()["ran"]
    assert set(ran) == {"linear_attention"}, ran  # the full-attention layers call none of them
    rules = {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"}
    assert ran["linear_attention"].keys() == rules | {"causal_conv1d_fn", "causal_conv1d_update"}
    assert all(module == "transformers.models.qwen3_5.modeling_qwen3_5" for module in ran["linear_attention"].values())
    assert rt.kernels.label == "torch"
    assert generate(rt, list(range(12))) == before  # the recorder is gone: the same calls, the same tokens
    assert rt.kernels.to_json()["ran"] == ran  # and it records only while open
