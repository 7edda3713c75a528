"""A decode worker's batch sized by its memory: hundreds of rows and more by default, fewer when rows are large."""

from __future__ import annotations

import pytest

from minifaas.config import ClusterConfig
from minifaas.model.batch_decoder import BatchDecoder, make_decoder
from minifaas.model.decode_memory import (
    MAX_ROWS,
    MEMORY_SHARE,
    ROW_CONTEXT,
    RowBytes,
    row_bytes,
    sized,
    sized_for,
    within_share,
)
from minifaas.model.decoder import DecoderConfig
from minifaas.model.interleaved_decoder import InterleavedDecoder
from minifaas.model.kv_size import kv_profile
from minifaas.model.loader import ModelSpec, load_config_dict
from minifaas.model.runtime import ModelRuntime


@pytest.fixture(scope="module")
def runtime() -> ModelRuntime:
    return ModelRuntime.load("shakespeare-qwen3.5")


def test_a_row_of_the_default_model_is_its_linear_state_plus_its_attention_kv_per_token(runtime: ModelRuntime) -> None:
    row = row_bytes(runtime)  # float32 on the CPU: 6 Gated DeltaNet layers, 2 full-attention layers
    recurrent, conv = 8 * 32 * 32 * 4, (2 * 4 * 32 + 8 * 32) * 4 * 4
    assert row == RowBytes(fixed=6 * (recurrent + conv), per_token=2 * 2 * 2 * 64 * 4)
    as_shipped = RowBytes.of(kv_profile(load_config_dict(ModelSpec.resolve("shakespeare-qwen3.5"))))
    assert as_shipped.per_token == row.per_token // 2  # the config says bfloat16: its KV is half as large


def test_the_default_batch_is_what_memory_holds_in_the_range_vllm_uses() -> None:
    assert DecoderConfig().max_batch == 0 and ClusterConfig().max_batch == 0  # sized when the worker starts
    row = RowBytes(fixed=245_760, per_token=2048)
    roomy = sized(DecoderConfig(), row, memory=16 << 30)
    assert roomy.max_batch == MAX_ROWS >= 256 and roomy.batched
    assert roomy.step_token_budget == int((16 << 30) * MEMORY_SHARE) // row.per_token
    small = sized(DecoderConfig(), row, memory=1 << 30)
    assert 1 <= small.max_batch == int((1 << 30) * MEMORY_SHARE) // (row.fixed + ROW_CONTEXT * row.per_token) < 256
    assert sized(DecoderConfig(max_batch=8, step_token_budget=100), row, memory=1) == DecoderConfig(8, 100)
    assert sized(DecoderConfig(), RowBytes(fixed=1 << 20, per_token=0), memory=1 << 30).step_token_budget > 1 << 30


def test_a_decoder_left_at_auto_gets_the_rows_this_hosts_memory_holds(runtime: ModelRuntime) -> None:
    decoder = make_decoder(runtime, DecoderConfig())
    # the host's memory read again: the suite's other processes, allocating meanwhile, move it a little
    again = sized_for(DecoderConfig(), runtime)
    assert isinstance(decoder, BatchDecoder) and decoder.config.max_batch == again.max_batch
    assert decoder.config.step_token_budget == pytest.approx(again.step_token_budget, rel=0.05)
    assert decoder.config.max_batch >= 256  # any host that runs the suite has the memory for it
    assert isinstance(make_decoder(runtime, DecoderConfig(max_batch=1)), InterleavedDecoder)


def test_a_gpu_worker_sizes_within_its_memory_fraction_not_the_cards_free_memory() -> None:
    gib = 1 << 30
    # a third of a 141 GiB card, 2 GiB of it held already, while the card has 120 GiB free: 45 GiB
    assert within_share(120 * gib, 141 * gib, 1 / 3, 2 * gib) == 141 * gib // 3 - 2 * gib
    # other processes took most of the card: what is free bounds it
    assert within_share(10 * gib, 141 * gib, 1 / 3, 2 * gib) == 10 * gib
    assert within_share(10 * gib, 141 * gib, 0.01, 2 * gib) == 0  # over its share already
