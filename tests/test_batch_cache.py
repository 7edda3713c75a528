"""A decode batch's buffers follow what its rows need: a long request pads only its own lane, and leaves nothing.

The buffers of a batch's full-attention layers are padded to the longest row. Were a long prompt's row to share
them with short ones, every short row would hold (and attend to) its length; were they never to shrink, a burst
of short streams after it would grow its rows into buffers that long, copying rows x that length each time the
batch grew: the stall after a 32K-token prompt (docs/RESULTS.md, section 35). Here the long prompt is 5,000
tokens (past ``LANE_TOKENS``) and the burst 100 rows of 40.
"""

from __future__ import annotations

import pytest
import torch

from minifaas.model.batch_cache import SLACK, PaddedKVLayer, fitted
from minifaas.model.batch_decoder import LANE_TOKENS, BatchDecoder, Lane, lane_of
from minifaas.model.decoder import DecoderConfig
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

LONG, SHORT, BURST = 5000, 40, 100


@pytest.fixture(scope="module")
def runtime() -> ModelRuntime:
    return ModelRuntime.load("shakespeare-qwen3.5")


def kv_buffers(lane: Lane) -> list[torch.Tensor]:
    return [b for layer in lane.cache.layers if isinstance(layer, PaddedKVLayer) for b in layer.buffers.values()]


def fits(lane: Lane) -> bool:
    rows, width = lane.cache.rows, max(lane.cache.lengths) + 1
    return all(rows <= b.shape[0] <= 4 * rows + SLACK and width <= b.shape[2] <= 4 * width + SLACK
               for b in kv_buffers(lane))  # fmt: skip


def test_a_long_request_decodes_in_its_own_lane_and_a_burst_after_it_gets_buffers_sized_for_itself(
    runtime: ModelRuntime,
) -> None:
    assert lane_of(SHORT) == 0 < lane_of(LONG) and LONG > LANE_TOKENS
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    decoder = BatchDecoder(runtime, DecoderConfig(max_batch=BURST + 1))
    long = runtime.prefill([(7 * i + 3) % 256 for i in range(LONG)], chunk_tokens=512)
    short = runtime.prefill([(5 * i + 1) % 256 for i in range(SHORT)])
    decoder.submit("long", long.state, long.next_token, params)
    for i in range(8):
        decoder.submit(f"beside-{i}", short.state, short.next_token, params)
    decoder.step()
    beside, own = decoder.lanes[0], decoder.lanes[lane_of(LONG)]
    assert [r.request for r in own.running] == ["long"] and len(beside.running) == 8
    assert fits(beside) and fits(own)  # the short rows hold their own length, not the long one's
    while decoder.load:
        decoder.step()
    assert list(decoder.lanes) == [0]  # the long lane's buffers went with its row
    for i in range(BURST):
        decoder.submit(f"short-{i}", short.state, short.next_token, params)
    decoder.step()
    assert decoder.cache.rows == BURST and fits(decoder.lanes[0])


def test_a_buffer_doubles_while_small_grows_by_a_quarter_when_large_and_shrinks_once_four_times_too_large() -> None:
    buf = torch.arange(2 * 100, dtype=torch.float32).reshape(2, 100)
    assert fitted(buf, {1: 100}) is buf and fitted(buf, {1: 25}) is buf  # within four times (and the slack): kept
    grown = fitted(buf, {1: 101})
    assert grown.shape == (2, 203) and torch.equal(grown[:, :100], buf) and not grown[:, 100:].any()
    shrunk = fitted(grown, {1: 20})
    assert shrunk.shape == (2, 41) and torch.equal(shrunk[:, :20], buf[:, :20])
    assert fitted(grown, {1: 20}, shrink=False) is grown  # between the times a buffer may shrink: kept
    assert fitted(torch.zeros(1, 32000), {1: 32001}).shape == (1, 40002)  # a long row: a quarter more, not double


def test_a_buffer_that_grows_on_one_dimension_shrinks_the_other_in_the_same_copy() -> None:
    buf = torch.ones(4, 1000)
    both = fitted(buf, {0: 5, 1: 40}, shrink=False)  # one more row: the copy is made anyway, so it is narrowed too
    assert both.shape == (11, 81) and torch.equal(both[:4, :40], buf[:, :40]) and not both[4:].any()


def test_long_rows_that_come_and_go_among_short_ones_do_not_copy_the_buffers_each_time(runtime: ModelRuntime) -> None:
    """Width grows when a long row joins and, were it to shrink each time the row left, every long row would
    copy the whole batch's buffers twice. They may shrink only every ``SHRINK_EVERY`` steps."""
    long = runtime.prefill([(7 * i + 3) % 256 for i in range(2000)], chunk_tokens=512)
    short = runtime.prefill([(5 * i + 1) % 256 for i in range(SHORT)])
    assert lane_of(2000) == 0
    decoder = BatchDecoder(runtime, DecoderConfig(max_batch=64))
    for i in range(16):
        decoder.submit(f"short-{i}", short.state, short.next_token, SamplingParams(max_tokens=60, ignore_eos=True))
    decoder.step()
    seen = []
    for cycle in range(10):  # a long row for two steps, then three steps without it
        decoder.submit(f"long-{cycle}", long.state, long.next_token, SamplingParams(max_tokens=2, ignore_eos=True))
        for _ in range(5):
            decoder.step()
            seen.append(kv_buffers(decoder.lanes[0])[0])
    assert len({b.data_ptr() for b in seen}) <= 3  # grown once for the long rows, shrunk at most once
    while decoder.load:
        decoder.step()
