"""The KV codecs without sockets: lossless is bit-exact, lossy stays within its error, frames pick the right one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minifaas.codec import block_scaled
from minifaas.codec.codec import (
    ALL_CODECS,
    MIN_CODED_BYTES,
    Codec,
    FrameDecoder,
    FrameEncoder,
    PlaneDecoder,
    PlaneEncoder,
    codecs_for,
    frame_codec,
    offer_mask,
    offered,
    split,
    usable,
)
from minifaas.model.layer_state import DTYPE_CODES, StateKind, checksum, tensor_bytes
from minifaas.net.errors import CorruptFrameError

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def joined(parts: list) -> memoryview:
    return memoryview(bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts)))


def kv_like(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values spread like attention keys: most near 1, a few outliers."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))).to(dtype)


SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 65504.0, 3.0e38, -2.5]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_lossless_is_bit_exact_special_values_included(dtype: torch.dtype) -> None:
    values = torch.cat([kv_like(5000, dtype), torch.tensor(SPECIALS).to(dtype)])
    raw = tensor_bytes(values)
    coded = FrameEncoder().encode(Codec.LOSSLESS, dtype, raw)
    assert coded.codec is Codec.LOSSLESS and coded.nbytes < len(raw)
    out = memoryview(bytearray(len(raw)))
    crc, seconds = FrameDecoder().decode_into(Codec.LOSSLESS, DTYPE_CODES[dtype], joined(coded.parts), out)
    assert bytes(out) == bytes(raw) and crc == coded.crc == checksum(raw) and seconds >= 0


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=0, max_size=3000), width=st.sampled_from([2, 4]))
def test_byte_planes_round_trip_any_bytes(data: bytes, width: int) -> None:
    raw = memoryview(data[: len(data) - len(data) % width])
    payload = joined(PlaneEncoder().encode(raw, width))
    out = memoryview(bytearray(len(raw)))
    PlaneDecoder().decode_into(payload, width, out)
    assert bytes(out) == bytes(raw)


def test_the_accelerated_coder_keeps_literal_coding_and_decodes_like_the_full_search() -> None:
    # the package's dependencies include cffi, so the accelerated coder is the one a worker runs
    fast, full = PlaneEncoder(), PlaneEncoder(accelerated=False)
    assert fast.accelerated and not full.accelerated
    raw = tensor_bytes(kv_like(1 << 17, torch.bfloat16))
    sizes = []
    for encoder in (fast, full):
        payload = joined(encoder.encode(raw, 2))
        out = memoryview(bytearray(len(raw)))
        PlaneDecoder().decode_into(payload, 2, out)
        assert bytes(out) == bytes(raw)
        sizes.append(len(payload))
    top = len(raw) // 2
    # with literal coding off, zstd at this acceleration leaves the top plane within a few % of its size
    assert sizes[0] - top < 0.5 * top
    assert sizes[0] < 1.1 * sizes[1]


def test_the_top_plane_is_sign_and_exponent() -> None:
    # bf16 0x3F80 is 1.0: sign 0, exponent 127 -> top byte 0x3F (sign + exponent bits 7..1)
    one = torch.ones(4, dtype=torch.bfloat16)
    top, rest = split(tensor_bytes(one), 2)
    assert top.tolist() == [0x3F] * 4 and bytes(rest[0]) == b"\x80" * 4
    top32, rest32 = split(tensor_bytes(torch.tensor([-2.0])), 4)  # 0xC0000000
    assert top32.tolist() == [0xC0] and bytes(rest32[0]) + bytes(rest32[1]) == b"\x00" * 3


def test_noise_goes_uncoded() -> None:
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    coded = FrameEncoder().encode(Codec.LOSSLESS, torch.bfloat16, memoryview(noise))
    assert coded.codec is Codec.NONE and coded.nbytes == noise.nbytes and coded.crc == checksum(memoryview(noise))


@pytest.mark.parametrize("code", [Codec.FP8, Codec.INT8])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_lossy_codes_stay_close_and_checksum_what_the_receiver_writes(code: Codec, dtype: torch.dtype) -> None:
    values = kv_like(3 * block_scaled.BLOCK + 5, dtype, seed=2)  # a short last block
    raw = tensor_bytes(values)
    coded = FrameEncoder().encode(code, dtype, raw)
    assert coded.codec is code
    assert coded.nbytes == block_scaled.payload_bytes(values.numel())
    out = memoryview(bytearray(len(raw)))
    crc, _ = FrameDecoder().decode_into(code, DTYPE_CODES[dtype], joined(coded.parts), out)
    assert crc == coded.crc
    got = torch.frombuffer(out, dtype=torch.uint8).view(dtype).float()
    exact = values.float()
    error = ((got - exact).norm() / exact.norm()).item()
    assert 0 < error < (0.05 if code is Codec.FP8 else 0.02)
    blocks = exact.view(-1)[: 3 * block_scaled.BLOCK].view(3, -1)  # no element moves by more than half a step
    step = blocks.abs().amax(dim=1, keepdim=True) / (127 if code is Codec.INT8 else 8)
    assert ((got[: 3 * block_scaled.BLOCK].view(3, -1) - blocks).abs() <= step).all()


def test_lossy_on_a_non_finite_range_goes_lossless() -> None:
    values = torch.cat([kv_like(2048, torch.bfloat16), torch.tensor([float("inf")], dtype=torch.bfloat16)])
    coded = FrameEncoder().encode(Codec.FP8, torch.bfloat16, tensor_bytes(values))
    assert coded.codec is Codec.LOSSLESS


def test_zero_blocks_decode_to_zero() -> None:
    values = torch.zeros(4 * block_scaled.BLOCK)
    coded = FrameEncoder().encode(Codec.INT8, torch.float32, tensor_bytes(values))
    out = memoryview(bytearray(values.numel() * 4))
    FrameDecoder().decode_into(Codec.INT8, DTYPE_CODES[torch.float32], joined(coded.parts), out)
    assert not any(out)


@pytest.mark.parametrize("code", [Codec.FP8, Codec.INT8])
def test_a_block_of_subnormals_decodes_finite_and_near_zero(code: Codec) -> None:
    values = torch.zeros(2 * block_scaled.BLOCK)
    values[3], values[block_scaled.BLOCK + 5] = 1e-44, -3e-45  # amax / top rounds to a zero scale
    coded = FrameEncoder().encode(code, torch.float32, tensor_bytes(values))
    out = memoryview(bytearray(values.numel() * 4))
    FrameDecoder().decode_into(code, DTYPE_CODES[torch.float32], joined(coded.parts), out)
    decoded = torch.frombuffer(out, dtype=torch.float32)
    assert torch.isfinite(decoded).all() and decoded.abs().max() <= 1e-44
    assert coded.crc == checksum(bytes(out))  # the header checksum is that of what the receiver writes


def test_frame_codec_rules() -> None:
    big = 1 << 20
    fa, swa, linear = StateKind.FULL_ATTENTION, StateKind.SLIDING_WINDOW, StateKind.LINEAR_ATTENTION
    assert frame_codec(Codec.FP8, fa, torch.bfloat16, big) is Codec.FP8
    assert frame_codec(Codec.INT8, swa, torch.float16, big) is Codec.INT8
    assert frame_codec(Codec.FP8, linear, torch.float32, big) is Codec.LOSSLESS  # recurrent state stays exact
    assert frame_codec(Codec.LOSSLESS, fa, torch.int64, big) is Codec.NONE
    assert frame_codec(Codec.LOSSLESS, fa, torch.float32, MIN_CODED_BYTES - 4) is Codec.NONE
    assert frame_codec(Codec.LOSSLESS, fa, torch.float32, big + 2) is Codec.NONE  # not whole elements
    assert frame_codec(Codec.NONE, fa, torch.float32, big) is Codec.NONE


def test_offers_and_what_a_transfer_may_use() -> None:
    assert offered(offer_mask(ALL_CODECS)) == ALL_CODECS
    assert offered(offer_mask(frozenset())) == {Codec.NONE}
    lossless_only = offered(offer_mask(frozenset({Codec.LOSSLESS})))
    assert usable(Codec.FP8, lossless_only) is Codec.LOSSLESS
    assert usable(Codec.LOSSLESS, frozenset({Codec.NONE})) is Codec.NONE
    assert usable(Codec.INT8, ALL_CODECS) is Codec.INT8
    assert Codec.named("fp8") is Codec.FP8
    with pytest.raises(ValueError, match="known: none, lossless, fp8, int8"):
        Codec.named("gzip")


@pytest.mark.parametrize("codec", [Codec.LOSSLESS, Codec.FP8])
def test_damaged_or_short_payloads_are_corrupt_frames(codec: Codec) -> None:
    values = kv_like(4096, torch.bfloat16)
    raw = tensor_bytes(values)
    coded = FrameEncoder().encode(codec, torch.bfloat16, raw)
    payload = joined(coded.parts)
    out = memoryview(bytearray(len(raw)))
    decoder = FrameDecoder()
    with pytest.raises(CorruptFrameError):
        decoder.decode_into(codec, DTYPE_CODES[torch.bfloat16], payload[:-1], out)
    damaged = bytearray(payload)
    damaged[12 if codec is Codec.LOSSLESS else -1] ^= 0x7F  # inside the zstd frame, or a code
    try:
        crc, _ = decoder.decode_into(codec, DTYPE_CODES[torch.bfloat16], memoryview(damaged), out)
    except CorruptFrameError:
        return
    assert crc != coded.crc  # decoded to something else: the receiver's checksum of the decoded bytes catches it


def test_what_each_worker_mode_sends_with_or_offers() -> None:
    assert codecs_for("none") == frozenset()
    assert codecs_for("auto") == codecs_for("lossless") == {Codec.LOSSLESS}  # auto never codes lossy
    assert codecs_for("fp8") == {Codec.LOSSLESS, Codec.FP8} and codecs_for("int8") == {Codec.LOSSLESS, Codec.INT8}
