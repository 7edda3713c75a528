"""The codec choice, with no event loop: compress only where the link time saved exceeds the coding time."""

from __future__ import annotations

import math

import pytest

from minifaas.policy.codec_policy import (
    CodecEstimate,
    CodecSample,
    CompressionPolicy,
    LinkShare,
    TransferShape,
)

MB = 1e6
LOSSLESS = CodecEstimate(ratio=1.25, encode_bps=500 * MB, decode_bps=1000 * MB)  # break-even 66.7 MB/s


def policy(mode: str = "auto", estimate: CodecEstimate | None = LOSSLESS) -> CompressionPolicy:
    p = CompressionPolicy(mode)
    if estimate is not None:
        p.estimates["lossless"] = estimate
    return p


def transfer_s(nbytes: float, bw: float, estimate: CodecEstimate, coded: bool) -> float:
    if not coded:
        return nbytes / bw
    return nbytes / estimate.ratio / bw + nbytes / estimate.encode_bps + nbytes / estimate.decode_bps


def test_break_even_is_where_saved_link_time_equals_coding_time() -> None:
    bw = LOSSLESS.break_even_bps
    assert bw == pytest.approx((1 - 1 / 1.25) / (1 / (500 * MB) + 1 / (1000 * MB)))
    assert transfer_s(1e9, bw, LOSSLESS, True) == pytest.approx(transfer_s(1e9, bw, LOSSLESS, False))
    assert CodecEstimate(1.0, 1e9, 1e9).break_even_bps == 0  # a codec that does not shrink never pays


@pytest.mark.parametrize("mbit", [1, 10, 50, 200, 500, 533, 534, 1000, 10_000])
def test_auto_is_never_slower_than_none(mbit: float) -> None:
    choice = policy().choose(LinkShare(mbit * 1e6))
    bw = mbit * 1e6 / 8
    chosen = transfer_s(1e8, bw, LOSSLESS, choice.codec == "lossless")
    assert chosen <= transfer_s(1e8, bw, LOSSLESS, False) + 1e-12
    assert choice.codec == ("lossless" if bw < LOSSLESS.break_even_bps else "none")
    assert choice.reason == ("saves_time" if choice.codec == "lossless" else "costs_more")


def test_a_busy_link_leaves_less_for_a_new_transfer() -> None:
    fast = 800e6  # 100 MB/s: alone on it, lossless does not pay
    assert policy().choose(LinkShare(fast)).codec == "none"
    assert policy().choose(LinkShare(fast, utilisation=0.7, transfers=2)).codec == "lossless"  # a third left
    assert policy().choose(LinkShare(fast, utilisation=0.7)).codec == "none"  # nothing on it now: all of it
    assert policy().choose(LinkShare(fast, utilisation=1.0, transfers=1)).codec == "lossless"  # a half share
    assert LinkShare(fast, utilisation=1.0, transfers=3).expected_bytes_per_s == pytest.approx(fast / 8 / 4)
    assert LinkShare(fast, utilisation=0.5, transfers=3).expected_bytes_per_s == pytest.approx(fast / 8 / 2)


def test_modes() -> None:
    assert policy("none").choose(LinkShare(1e3)).codec == "none"
    assert policy("lossless").choose(LinkShare(1e12)).codec == "lossless"
    assert policy("fp8").choose(LinkShare(1e12)).reason == "forced"
    assert policy("auto").choose(LinkShare(math.inf)).reason == "unlimited_link"
    assert policy("auto", None).choose(LinkShare(1e3)).reason == "unmeasured"  # nothing measured: no guess
    with pytest.raises(ValueError, match="none, lossless, fp8, int8, auto"):
        CompressionPolicy("zstd")
    with pytest.raises(ValueError, match="smoothing must be in"):
        CompressionPolicy("auto", "x")  # type: ignore[arg-type]


def test_lossy_is_never_chosen_automatically() -> None:
    p = policy()
    p.estimates["fp8"] = CodecEstimate(3.9, 1e12, 1e12)  # cheaper and smaller than lossless
    assert {p.choose(LinkShare(mbit * 1e6)).codec for mbit in (0.1, 1, 10, 100, 1e4)} <= {"none", "lossless"}


def test_meter_averages_what_transfers_report() -> None:
    meter = CompressionPolicy(smoothing=0.5)
    meter.observe(CodecSample("lossless", 1000, 800, 1e-6, 5e-7))
    assert meter.estimates["lossless"] == CodecEstimate(1.25, 1e9, 2e9)
    meter.observe(CodecSample("lossless", 1000, 1000, 1e-6, 5e-7))
    assert meter.estimates["lossless"].ratio == pytest.approx(1.125)
    meter.observe(CodecSample("none", 1000, 1000, 0, 0))
    meter.observe(CodecSample("lossless", 1000, 0, 1, 1))  # nothing measured: ignored
    assert set(meter.estimates) == {"lossless"} and meter.estimates["lossless"].ratio == pytest.approx(1.125)


def test_only_what_is_left_after_the_prefill_counts() -> None:
    """Streaming while the prefill runs: the bulk's coding hides behind it too, the tail's does not."""
    hidden = TransferShape(nbytes=10e6, prefill_s=2.0, tail_bytes=0.5e6)  # 0.8 s of link time in 2 s of prefill
    assert hidden.exposed_s(12.5e6) == pytest.approx(0.04)  # the tail alone
    assert hidden.exposed_s(12.5e6, LOSSLESS) == pytest.approx(0.5e6 / (1.25 * 12.5e6) + 0.5e6 / 500e6 + 0.5e-3)
    # link-bound above the break-even: alone it would not pay, but the bulk's coding runs during the prefill
    bulk = TransferShape(nbytes=1e9, prefill_s=5.0, tail_bytes=1e6)
    fast = LinkShare(800e6)  # 100 MB/s
    assert policy().choose(fast).codec == "none"
    assert bulk.exposed_s(100e6) == pytest.approx(5.0) and bulk.exposed_s(100e6, LOSSLESS) == pytest.approx(3.0)
    assert policy().choose(fast, bulk).codec == "lossless"


def test_without_overlap_the_shape_rule_is_the_break_even_rule() -> None:
    for mbit in (100, 500, 533, 534, 600):
        bw = mbit * 1e6 / 8
        shape = TransferShape(nbytes=3e6)
        coded = shape.exposed_s(bw, LOSSLESS) < shape.exposed_s(bw)
        assert coded == (bw < LOSSLESS.break_even_bps)
        assert policy().choose(LinkShare(mbit * 1e6), shape).codec == ("lossless" if coded else "none")


def test_a_codec_slower_than_the_link_paces_the_stream() -> None:
    slow = CodecEstimate(ratio=2.0, encode_bps=10e6, decode_bps=1e9)
    shape = TransferShape(nbytes=100e6, prefill_s=1.0, tail_bytes=1e6)
    assert shape.exposed_s(50e6, slow) == pytest.approx(100e6 / 10e6 - 1.0)  # the coder, not the link
    assert policy(estimate=slow).choose(LinkShare(400e6), shape).codec == "none"
