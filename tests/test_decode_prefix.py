"""A decode node's received-KV cache: an increment joined onto the pinned prefix is the whole state."""

from __future__ import annotations

import torch

from minifaas.cache.pool_config import PoolConfig
from minifaas.model.interleaved_decoder import DecodeStream
from minifaas.model.layer_state import LayerState, ModelState, StateKind
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.worker.prefix_store import DecodePrefixCache

BLOCK = 16
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _increment(state: ModelState, start: int) -> list[LayerState]:
    """What a prefill node sends when the decode node holds the first ``start`` tokens' KV."""
    return [s.slice_tokens(start, s.seq_len) if s.kind is StateKind.FULL_ATTENTION else s for s in state.layers]


def _same(a: LayerState, b: LayerState) -> bool:
    """Equal up to float rounding: the kept prefix was computed in an earlier, shorter forward."""
    return (a.layer, a.kind, a.seq_len) == (b.layer, b.kind, b.seq_len) and all(
        torch.allclose(x, y, atol=1e-5) for (_, x), (_, y) in zip(a.slots, b.slots, strict=True)
    )


def test_increment_joined_onto_the_kept_prefix_decodes_like_the_whole_state() -> None:
    rt = ModelRuntime.load("kimi-linear-tiny")
    cache = DecodePrefixCache(PoolConfig("d", 1 << 30, BLOCK), "m", rt.layout.kinds, "d")
    first = [(3 * i + 1) % 256 for i in range(70)]
    cache.pin(1, first, 0)
    cache.received(1, rt.prefill(first).state, now=0.0)
    events = cache.pool.drain_events()
    assert [e.length for e in events] == [16, 32, 48, 64] and {e.node for e in events} == {"d"}

    turn = [*first, *[(5 * i + 7) % 256 for i in range(30)]]
    whole = rt.prefill(turn)
    pinned = cache.pin(2, turn, 70)
    assert pinned == 64  # whole blocks only: the partial block's KV crosses again
    joined = [cache.join_layer(2, s) for s in _increment(whole.state, pinned)]
    assert all(_same(j, w) for j, w in zip(joined, whole.state.layers, strict=True))
    state = ModelState(joined, len(turn))
    cache.received(2, state, now=1.0)
    assert cache.pool.counts["kv_lookups_hit"] == 1
    assert all(e.refs == 0 for e in cache.pool.entries())  # the pin went with the delivery
    assert DecodeStream(rt, state, whole.next_token, PARAMS).run() == reference_tokens(rt, turn, PARAMS)


def test_a_cancelled_transfer_unpins_and_a_disabled_cache_pins_nothing() -> None:
    rt = ModelRuntime.load("qwen3-tiny")
    layout = rt.layout.kinds
    tokens = [(7 * i) % 256 for i in range(40)]
    cache = DecodePrefixCache(PoolConfig("d", 1 << 30, BLOCK), "m", layout, "d")
    cache.pin(1, tokens, 0)
    cache.received(1, rt.prefill(tokens).state, 0.0)
    assert cache.pin(2, tokens, 39) == 32
    assert any(e.refs for e in cache.pool.entries())
    cache.cancel(2)
    assert all(e.refs == 0 for e in cache.pool.entries())

    off = DecodePrefixCache(PoolConfig("d", 1 << 30, BLOCK, enabled=False), "m", layout, "d")
    off.pin(1, tokens, 0)
    off.received(1, rt.prefill(tokens).state, 0.0)
    assert off.pin(2, tokens, 39) == 0 and off.pool.used_bytes == 0
