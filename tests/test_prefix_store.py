"""The prefill node's prefix cache with real models: greedy output with any hit equals the cold output, and the
same prompt again, held whole, runs no forward."""

from __future__ import annotations

import pytest
import torch

from minifaas.cache.pool_config import PoolConfig
from minifaas.cache.prefix_index import EntryKind
from minifaas.model.interleaved_decoder import DecodeStream
from minifaas.model.layer_state import LayerState, StateKind
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.model.state_layout import needs_snapshot
from minifaas.worker.prefix_store import PrefixStore

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
BLOCK = 16
PRESETS = ["kimi-linear-tiny", "mimo-v2-tiny", "qwen3-tiny", "qwen3.5-tiny"]


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i + (i * i) % 97) % 256 for i in range(n)]


def _serve(store: PrefixStore, rt: ModelRuntime, tokens: list[int]) -> tuple[list[int], int]:
    plan = store.begin(tokens)
    result = store.compute(rt, plan, sampling=PARAMS)
    store.finish(plan, result, now=0.0)
    assert result.state.seq_len == len(tokens)
    assert result.computed_tokens == len(tokens) - plan.hit_tokens
    out = DecodeStream(rt, result.state, result.next_token, PARAMS).run()
    return out, plan.hit_tokens


@pytest.mark.parametrize("preset", PRESETS)
def test_output_with_any_hit_equals_cold_output(preset: str) -> None:
    rt = ModelRuntime.load(preset)
    layout = rt.layout.kinds
    hybrid = needs_snapshot(layout)
    assert hybrid == (preset != "qwen3-tiny")
    store = PrefixStore(PoolConfig("n", 1 << 30, BLOCK, 2, hybrid), preset, layout, "n")
    first = _tokens(1, 5 * BLOCK + 3)  # 83 tokens: snapshots at 32, 64 and 83 when hybrid
    again = first  # the whole prompt again: its end snapshot kept the logits, so nothing is computed
    branch = first[:40] + _tokens(2, 30)  # shares 40 tokens: usable up to the snapshot at 32 (hybrid) or block 32
    longer = first + _tokens(3, 50)  # continues the first prompt: its end snapshot is an exact hit
    cold = {id(p): reference_tokens(rt, p, PARAMS) for p in (first, branch, longer)}

    out, hit = _serve(store, rt, first)
    assert (out, hit) == (cold[id(first)], 0)
    out, hit = _serve(store, rt, again)
    assert (out, hit) == (cold[id(first)], len(first))
    out, hit = _serve(store, rt, branch)
    assert (out, hit) == (cold[id(branch)], 32)
    out, hit = _serve(store, rt, longer)
    assert (out, hit) == (cold[id(longer)], 83)
    assert store.pool.counts["lookups_hit"] == 3


def test_reuse_policy_splits_only_at_a_prefix_seen_before() -> None:
    """Under ``reuse`` a cold prompt runs as one segment, and the same prompt again loads it whole; a second
    prompt that shares blocks with it takes a snapshot where they branch, and a third one loads it, with the
    cold output."""
    rt = ModelRuntime.load("kimi-linear-tiny")
    layout = rt.layout.kinds
    store = PrefixStore(PoolConfig("n", 1 << 30, BLOCK, 2, snapshot_policy="reuse"), "m", layout, "n")
    a, b, c = (_tokens(1, 3 * BLOCK) + _tokens(seed, 40) for seed in (4, 5, 6))
    plan = store.begin(a)
    assert (plan.points, plan.snapshot_end) == ([], True)  # no split: only the end's state is kept
    store.release(plan)
    assert _serve(store, rt, a)[1] == 0
    assert _serve(store, rt, a) == (reference_tokens(rt, a, PARAMS), len(a))  # the second send hits
    plan = store.begin(b)
    assert (plan.hit_tokens, plan.points, plan.snapshot_end) == (0, [3 * BLOCK], True)
    store.release(plan)
    assert _serve(store, rt, b)[1] == 0
    assert _serve(store, rt, c) == (reference_tokens(rt, c, PARAMS), 3 * BLOCK)
    assert _serve(store, rt, [*a, 9])[1] == len(a)  # the next turn continues from the end snapshot


def test_the_same_prompt_again_streams_the_same_state_and_samples_the_same_tokens() -> None:
    """A whole-prompt hit runs no forward: every layer it hands on equals the miss's, and a seeded sampled
    request gets the tokens the miss got, first token included."""
    rt = ModelRuntime.load("qwen3.5-tiny")
    store = PrefixStore(PoolConfig("n", 1 << 30, BLOCK, 2, snapshot_policy="reuse"), "m", rt.layout.kinds, "n")
    tokens = _tokens(7, 4 * BLOCK + 9)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)

    class Layers(list):  # a sink that keeps what it is given
        def put_layer(self, layer: LayerState) -> None:
            self.append(layer)

        def put_tokens(self, piece: LayerState, start: int, total: int) -> None:
            raise AssertionError("a prefill in one forward puts whole layers")

    def send() -> tuple[int, int, list[LayerState], list[int]]:
        layers = Layers()
        plan = store.begin(tokens)
        result = store.compute(rt, plan, layers, sampled)
        store.finish(plan, result, now=0.0)
        out = DecodeStream(rt, result.state, result.next_token, sampled).run()
        return plan.hit_tokens, result.computed_tokens, layers, out

    miss_hit, miss_computed, miss_layers, miss_out = send()
    hit, computed, hit_layers, hit_out = send()
    assert (miss_hit, miss_computed, hit, computed) == (0, len(tokens), len(tokens), 0)
    assert hit_out == miss_out
    assert [s.layer for s in hit_layers] == [s.layer for s in miss_layers] == list(range(rt.num_states))
    for a, b in zip(miss_layers, hit_layers, strict=True):
        assert a.seq_len == b.seq_len == len(tokens)
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.slots, b.slots, strict=True))


def test_off_switches_store_nothing_and_take_no_snapshots_between_ends() -> None:
    rt = ModelRuntime.load("kimi-linear-tiny")
    layout = rt.layout.kinds
    assert layout.count(StateKind.FULL_ATTENTION) == 2
    tokens = _tokens(4, 4 * BLOCK + 5)
    off = PrefixStore(PoolConfig("n", 1 << 30, BLOCK, 2, enabled=False), "m", layout, "n")
    _serve(off, rt, tokens)
    assert off.pool.used_bytes == 0 and off.pool.drain_events() == []
    assert _serve(off, rt, tokens)[1] == 0

    ends_only = PrefixStore(PoolConfig("n", 1 << 30, BLOCK, 0), "m", layout, "n")
    plan = ends_only.begin(tokens)
    assert plan.points == [] and plan.snapshot_end
    ends_only.finish(plan, ends_only.compute(rt, plan), 0.0)
    events = ends_only.pool.drain_events()
    assert sorted(e.length for e in events if e.entry == "snapshot") == [len(tokens)]
    assert sum(e.entry == "block" for e in events) == 4
    assert _serve(ends_only, rt, tokens)[1] == len(tokens)  # the end snapshot, with its logits
    assert _serve(ends_only, rt, tokens[:-1])[1] == 0  # no snapshot below the end: nothing usable
    assert _serve(ends_only, rt, [*tokens, 1, 2, 3])[1] == len(tokens)


def test_a_pinned_hit_survives_a_full_pool_and_is_released() -> None:
    rt = ModelRuntime.load("qwen3.5-tiny")
    layout = rt.layout.kinds
    tokens = _tokens(5, 3 * BLOCK + 1)
    probe = PrefixStore(PoolConfig("n", 1 << 30, BLOCK, 1), "m", layout, "n")
    _serve(probe, rt, tokens)
    capacity = probe.pool.used_bytes  # room for exactly one prompt's entries
    store = PrefixStore(PoolConfig("n", capacity, BLOCK, 1), "m", layout, "n")
    _serve(store, rt, tokens)
    plan = store.begin([*tokens, 9])
    assert plan.hit_tokens == len(tokens)
    _serve(store, rt, _tokens(6, 3 * BLOCK + 1))  # a different prompt cannot evict the pinned hit
    assert store.pool.used_bytes <= capacity
    out = store.compute(rt, plan, sampling=PARAMS)
    store.finish(plan, out, 2.0)
    assert plan.lease.released
    decoded = DecodeStream(rt, out.state, out.next_token, PARAMS).run()
    assert decoded == reference_tokens(rt, [*tokens, 9], PARAMS)


def test_a_hit_whose_state_fails_to_load_is_not_left_pinned() -> None:
    rt = ModelRuntime.load("qwen3-tiny")
    store = PrefixStore(PoolConfig("n", 1 << 30, BLOCK, 1, False), "m", rt.layout.kinds, "n")
    tokens = _tokens(7, 3 * BLOCK + 1)
    _serve(store, rt, tokens)
    block = next(e for e in store.pool.entries() if e.kind is EntryKind.BLOCK and e.payload)
    block.payload = tuple(s.slice_tokens(0, BLOCK - 1) for s in block.payload)  # a cached state one token short
    with pytest.raises(ValueError, match="cached state covers"):
        store.begin(tokens)
    assert [e.refs for e in store.pool.entries()] == [0] * len(store.pool.entries()), "the failed hit stays pinned"
