"""Wire format and reassembly, without sockets: headers, limits, chunking, in-order rebuild."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic import synthetic_state

from minifaas.model.layer_state import Checksum, ModelState, checksum
from minifaas.model.state_codec import same_state
from minifaas.net.errors import CorruptFrameError, ProtocolError, TruncatedError
from minifaas.transport.wire import (
    HEADER_SIZE,
    UNCHECKED,
    FrameHeader,
    FrameType,
    Limits,
    Reassembly,
    control,
    split_chunks,
    split_token_range,
    unpack_header,
)

LIMITS = Limits(max_chunk_bytes=1 << 20, max_slot_bytes=1 << 24)


def new_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def chunk_header(**changes: object) -> FrameHeader:
    fields = dict(type=FrameType.CHUNK, transfer=7, length=16, crc=0, layer=1, kind=3, slot=0, n_slots=2)
    fields |= dict(name="recurrent.0", dtype=1, shape=(2, 8), seq_len=5, offset=0)
    fields |= changes
    return FrameHeader(**fields)  # type: ignore[arg-type]


def test_header_round_trip() -> None:
    h = chunk_header(offset=32, shape=(4, 4, 2), flags=UNCHECKED)
    raw = h.pack()
    assert len(raw) == HEADER_SIZE
    assert unpack_header(raw, LIMITS) == h


def test_control_frame_round_trip() -> None:
    raw = control(FrameType.ABORT, 99, b"because")
    h = unpack_header(raw[:HEADER_SIZE], LIMITS)
    assert (h.type, h.transfer, h.length) == (FrameType.ABORT, 99, 7)
    assert raw[HEADER_SIZE:] == b"because"


@pytest.mark.parametrize(
    ("position", "error"),
    [(0, ProtocolError), (4, ProtocolError), (30, CorruptFrameError), (100, CorruptFrameError)],
)
def test_damaged_header_is_refused(position: int, error: type[Exception]) -> None:
    raw = bytearray(chunk_header().pack())
    raw[position] ^= 0x40
    with pytest.raises(error):
        unpack_header(raw, LIMITS)


@pytest.mark.parametrize(
    "changes",
    [
        dict(shape=(1 << 20, 1 << 20)),  # a 4 TiB slot
        dict(length=2 << 20, shape=(1 << 20,)),  # chunk over the limit
        dict(offset=60, length=8),  # past the end of the slot
        dict(slot=2),  # slot index beyond the slot count
        dict(dtype=200),
        dict(kind=9),
    ],
)
def test_absurd_chunk_headers_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        unpack_header(chunk_header(**changes).pack(), LIMITS)


def test_control_frame_cannot_claim_a_large_payload() -> None:
    raw = FrameHeader(FrameType.END, 1, length=1 << 30).pack()
    with pytest.raises(ProtocolError):
        unpack_header(raw, LIMITS)


def rebuild(state: ModelState, chunk_bytes: int, order: random.Random | None = None) -> ModelState:
    chunks = [c for layer in state.layers for c in split_chunks(layer, chunk_bytes)]
    if order is not None:
        order.shuffle(chunks)
    r = Reassembly(3, 1 << 30, new_bytes)
    out = []
    for c in chunks:
        raw, payload = c.frame(3)
        h = unpack_header(raw, LIMITS)
        view = r.buffer_for(h)
        view[:] = payload
        out += r.commit(h, view)
    r.end(len(state.layers), sum(c.length for c in chunks))
    assert r.complete
    return ModelState(out, state.seq_len)


@settings(max_examples=25, deadline=None)
@given(chunk_bytes=st.integers(1, 3000), seed=st.integers(0, 1000))
def test_any_chunking_in_any_order_rebuilds_bit_exact(chunk_bytes: int, seed: int) -> None:
    state = synthetic_state(layers=8, tokens=20, width=8, seed=seed)
    assert same_state(rebuild(state, chunk_bytes, random.Random(seed)), state)


def test_layers_come_out_in_order_only_when_whole() -> None:
    state = synthetic_state(layers=4, tokens=8, width=4)
    r = Reassembly(1, 1 << 20, new_bytes)
    per_layer = [split_chunks(layer, 64) for layer in state.layers]
    ready_after: list[list[int]] = []
    for layer in (1, 0, 3, 2):  # layer 1 arrives first but must wait for layer 0
        for c in per_layer[layer]:
            raw, payload = c.frame(1)
            h = unpack_header(raw, LIMITS)
            view = r.buffer_for(h)
            view[:] = payload
            ready_after.append([s.layer for s in r.commit(h, view)])
    delivered = [x for batch in ready_after if batch for x in batch]
    assert delivered == [0, 1, 2, 3]
    assert ready_after[len(per_layer[1]) - 1] == []  # layer 1 complete, layer 0 not yet: nothing out


def test_corrupted_payload_is_caught() -> None:
    state = synthetic_state(layers=1, tokens=4, width=4)
    c = split_chunks(state.layers[0], 1 << 20)[0]
    raw, payload = c.frame(1)
    h = unpack_header(raw, LIMITS)
    r = Reassembly(1, 1 << 20, new_bytes)
    view = r.buffer_for(h)
    view[:] = payload
    view[len(view) // 2] ^= 1
    with pytest.raises(CorruptFrameError):
        r.commit(h, view)


def test_transfer_over_its_byte_limit_allocates_nothing() -> None:
    h = unpack_header(chunk_header(shape=(1024, 1024), length=4096).pack(), LIMITS)
    r = Reassembly(1, 1 << 20, new_bytes)
    with pytest.raises(ProtocolError):
        r.buffer_for(h)
    assert r.allocated == 0


def test_duplicate_chunk_is_a_protocol_error() -> None:
    state = synthetic_state(layers=1, tokens=4, width=4)
    c = split_chunks(state.layers[0], 32)[0]
    raw, payload = c.frame(1)
    h = unpack_header(raw, LIMITS)
    r = Reassembly(1, 1 << 20, new_bytes)
    view = r.buffer_for(h)
    view[:] = payload
    r.commit(h, view)
    with pytest.raises(ProtocolError):
        r.buffer_for(h)


def test_end_with_missing_layer_is_truncation() -> None:
    state = synthetic_state(layers=2, tokens=4, width=4)
    r = Reassembly(1, 1 << 20, new_bytes)
    sent = 0
    for c in split_chunks(state.layers[0], 1 << 20):
        raw, payload = c.frame(1)
        h = unpack_header(raw, LIMITS)
        view = r.buffer_for(h)
        view[:] = payload
        r.commit(h, view)
        sent += c.length
    with pytest.raises(TruncatedError):
        r.end(2, sent)


def test_split_refuses_what_the_wire_cannot_carry() -> None:
    from minifaas.model.layer_state import LayerState, StateKind

    state = LayerState(0, StateKind.LINEAR_ATTENTION, 1, (("x" * 40, torch.zeros(2)),))
    with pytest.raises(ValueError):
        split_chunks(state, 1024)


@pytest.mark.parametrize("cuts", [(0, 40), (0, 13, 40), (0, 1, 2, 39, 40), (0, 0, 17, 17, 40)])
def test_token_ranges_of_a_full_attention_layer_rebuild_it(cuts: tuple[int, ...]) -> None:
    layer = synthetic_state(layers=4, tokens=40, width=8).layers[3]  # keys float32, values bfloat16, 2 heads
    chunks = []
    for start, end in itertools.pairwise(cuts):
        chunks += split_token_range(layer.slice_tokens(start, end), start, 40, chunk_bytes=100)
    random.Random(len(cuts)).shuffle(chunks)
    r = Reassembly(1, 1 << 20, new_bytes)
    out = []
    for c in chunks:
        raw, payload = c.frame(1)
        h = unpack_header(raw, LIMITS)
        view = r.buffer_for(h)
        view[:] = payload
        out += r.commit(h, view)
    for earlier in range(3):  # the other layers of the transfer, so layer 3 can be handed on
        for c in split_chunks(synthetic_state(layers=4, tokens=40, width=8).layers[earlier], 1 << 20):
            raw, payload = c.frame(1)
            h = unpack_header(raw, LIMITS)
            view = r.buffer_for(h)
            view[:] = payload
            out += r.commit(h, view)
    assert same_state(ModelState(out[3:], 40), ModelState([layer], 40))


def test_token_range_must_fit_and_be_full_attention() -> None:
    state = synthetic_state(layers=4, tokens=8)
    with pytest.raises(ValueError):
        split_token_range(state.layers[3].slice_tokens(0, 8), 4, 10, 64)
    with pytest.raises(ValueError):
        split_token_range(state.layers[0], 0, 8, 64)


@pytest.mark.parametrize("size", [0, 1, 1000, (64 << 10) - 1, 64 << 10, (3 << 20) + 5])
def test_checksum_fed_in_pieces_equals_the_one_shot_checksum(size: int) -> None:
    data = random.Random(size).randbytes(size)
    whole = checksum(data)
    assert checksum(memoryview(data)) == whole
    for step in (1 << 10, 100_003, 1 << 20):
        pieces = Checksum()
        for at in range(0, size, step):
            pieces.update(memoryview(data)[at : at + step])
        assert pieces.value == whole, f"{size} bytes in pieces of {step}"
    if size:
        flipped = bytearray(data)
        flipped[-1] ^= 1
        assert checksum(flipped) != whole
