"""LayerState bytes: bit-exact round trips, and clear errors for anything damaged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minifaas.model import state_codec
from minifaas.model.layer_state import DTYPES, LayerState, StateKind
from minifaas.model.runtime import ModelRuntime
from minifaas.model.state_codec import StateCodecError


def encode_bytes(state: LayerState) -> bytes:
    return b"".join(bytes(p) for p in state_codec.encode(state))


def concat_tokens(head: LayerState, tail: LayerState) -> LayerState:
    """Join a full-attention prefix with the KV of the tokens that follow it."""
    if head.kind is not StateKind.FULL_ATTENTION or tail.kind is not StateKind.FULL_ATTENTION:
        raise ValueError("only full-attention states concatenate along tokens")
    if head.layer != tail.layer or [n for n, _ in head.slots] != [n for n, _ in tail.slots]:
        raise ValueError(f"cannot join layer {head.layer} with layer {tail.layer}")
    slots = tuple((n, torch.cat([a, b], dim=-2)) for (n, a), (_, b) in zip(head.slots, tail.slots))
    return LayerState(head.layer, head.kind, head.seq_len + tail.seq_len, slots)


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0,
        256,
        (int(torch.tensor(shape).prod()) * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=g,
    )
    return raw.view(dtype).reshape(shape)  # arbitrary bit patterns, NaNs included


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
@pytest.mark.parametrize("kind", list(StateKind), ids=lambda k: k.name)
def test_every_dtype_and_kind_round_trips_bit_exactly(dtype: torch.dtype, kind: StateKind) -> None:
    if kind is StateKind.LINEAR_ATTENTION:
        slots = (("conv.0", _random((1, 12, 4), dtype, 1)), ("recurrent.0", _random((1, 2, 4, 4), dtype, 2)))
    else:
        slots = (("keys", _random((1, 2, 9, 8), dtype, 3)), ("values", _random((1, 2, 9, 6), dtype, 4)))
    state = LayerState(5, kind, 9, slots)
    back = state_codec.decode(encode_bytes(state))
    assert (back.layer, back.kind, back.seq_len) == (5, kind, 9)
    assert [n for n, _ in back.slots] == [n for n, _ in slots]
    assert all(_same_bits(a, b) for (_, a), (_, b) in zip(slots, back.slots))


def test_encode_points_at_tensor_memory_without_copying() -> None:
    t = torch.arange(64, dtype=torch.float32).reshape(1, 1, 16, 4)
    parts = state_codec.encode(LayerState(0, StateKind.FULL_ATTENTION, 16, (("keys", t), ("values", t))))
    t[0, 0, 0, 0] = 42.0
    assert torch.frombuffer(bytearray(parts[1]), dtype=torch.float32)[0] == 42.0


def test_real_model_states_round_trip() -> None:
    rt = ModelRuntime.load("kimi-linear-tiny")
    for state in rt.prefill(list(range(50))).state.layers:
        back = state_codec.decode(encode_bytes(state))
        assert back.kind == state.kind and all(_same_bits(a, b) for (_, a), (_, b) in zip(state.slots, back.slots))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_flipped_byte_or_truncation_raises(data: st.DataObject) -> None:
    state = LayerState(
        3,
        StateKind.FULL_ATTENTION,
        5,
        (("keys", _random((1, 1, 5, 4), torch.float32, 7)), ("values", _random((1, 1, 5, 4), torch.bfloat16, 8))),
    )
    blob = bytearray(encode_bytes(state))
    if data.draw(st.booleans()):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] ^= data.draw(st.integers(1, 255))
    else:
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    with pytest.raises(StateCodecError):
        state_codec.decode(blob)


@pytest.mark.parametrize("damage", ["magic", "version", "dtype", "huge", "trailing"])
def test_specific_damage_gives_a_specific_message(damage: str) -> None:
    state = LayerState(0, StateKind.LINEAR_ATTENTION, 3, (("recurrent.0", torch.ones(2, 2)),))
    blob = bytearray(encode_bytes(state))
    head = state_codec._HEAD.size
    if damage == "magic":
        blob[0:4], match = b"XXXX", "magic"
    elif damage == "version":
        blob[4], match = 99, "version"
    elif damage == "dtype":
        blob[head], match = 200, "dtype"
    elif damage == "huge":
        blob[head + 4 : head + 12], match = (1 << 62).to_bytes(8, "little"), "refused"
    else:
        blob, match = blob + b"\0", "trailing"
    with pytest.raises(StateCodecError, match=match):
        state_codec.decode(blob)


def test_slicing_and_joining_full_attention_tokens() -> None:
    k = torch.arange(40, dtype=torch.float32).reshape(1, 1, 10, 4)
    state = LayerState(1, StateKind.FULL_ATTENTION, 10, (("keys", k), ("values", k * 2)))
    head, tail = state.slice_tokens(0, 6), state.slice_tokens(6, 10)
    assert head.seq_len == 6 and tail.seq_len == 4
    joined = concat_tokens(head, tail)
    assert torch.equal(joined.tensor("keys"), k) and torch.equal(joined.tensor("values"), k * 2)
    linear = LayerState(0, StateKind.LINEAR_ATTENTION, 10, (("recurrent.0", torch.ones(2)),))
    assert linear.slice_tokens(0, 10) is linear
    with pytest.raises(ValueError, match="only valid at length 10"):
        linear.slice_tokens(0, 6)
