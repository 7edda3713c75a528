"""Which codec a KV transfer gets: coding pays only when the link time it saves exceeds the time it costs.

``CompressionPolicy.choose`` compares what a transfer adds after its prefill ends (``TransferShape.exposed_s``),
coded and not, at the share of the link it can expect, with each codec's figures averaged from what coded
transfers report. ``auto`` picks ``none`` or ``lossless`` only: a lossy code changes the model's output.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass
from enum import StrEnum


class Compression(StrEnum):
    NONE = "none"
    LOSSLESS = "lossless"
    FP8 = "fp8"
    INT8 = "int8"
    AUTO = "auto"


MODES = tuple(m.value for m in Compression)


@dataclass(frozen=True, slots=True)
class CodecEstimate:
    ratio: float  # state bytes / bytes on the wire
    encode_bps: float  # state bytes coded per second at the sender
    decode_bps: float  # state bytes decoded per second at the receiver

    @property
    def break_even_bps(self) -> float:
        """The link bandwidth (bytes/s) below which this codec saves time."""
        if self.ratio <= 1:
            return 0.0
        return (1 - 1 / self.ratio) / (1 / self.encode_bps + 1 / self.decode_bps)


@dataclass(frozen=True, slots=True)
class TransferShape:
    """What is known of a transfer before it starts."""

    nbytes: float  # state bytes it will carry
    prefill_s: float = 0.0  # how long the prefill that produces them runs (0: unknown, nothing hides it)
    tail_bytes: float | None = None  # bytes final only when the prefill ends (None: all of them)

    @property
    def tail(self) -> float:
        return self.nbytes if self.tail_bytes is None else min(self.tail_bytes, self.nbytes)

    def exposed_s(self, bw: float, codec: CodecEstimate | None = None) -> float:
        """Seconds the transfer adds after its prefill at ``bw`` bytes/s, coded with ``codec`` or not."""
        if codec is None:
            return max(self.nbytes / bw - self.prefill_s, self.tail / bw)
        pace = min(codec.ratio * bw, codec.encode_bps, codec.decode_bps)  # state bytes/s of the coded stream
        tail_s = self.tail / (codec.ratio * bw) + self.tail / codec.encode_bps + self.tail / codec.decode_bps
        return max(self.nbytes / pace - self.prefill_s, tail_s)


@dataclass(frozen=True, slots=True)
class LinkShare:
    """What a new transfer can expect of the link, as measured now."""

    rate_bps: float  # the link's rate in bits/s (inf: no limit; 0: cut)
    utilisation: float = 0.0  # measured egress over the rate, 0..1
    transfers: int = 0  # transfers on the link now

    @property
    def expected_bytes_per_s(self) -> float:
        """The link's unused rate, but never less than a fair share among the transfers on it."""
        if math.isinf(self.rate_bps):
            return math.inf
        free = max(0.0, 1.0 - self.utilisation)
        return self.rate_bps / 8 * max(free, 1 / (self.transfers + 1))


@dataclass(frozen=True, slots=True)
class CodecChoice:
    codec: str  # none, lossless, fp8 or int8
    reason: str  # forced, saves_time, costs_more, unmeasured, unlimited_link
    break_even_bps: float  # bytes/s below which lossless pays (0 when unmeasured)


@dataclass(frozen=True, slots=True)
class CodecSample:
    """What one coded transfer (or a worker's start-up calibration) did: ``nbytes`` of state became
    ``wire_bytes`` on the wire, coded in ``encode_s`` and decoded in ``decode_s``."""

    codec: str
    nbytes: float
    wire_bytes: float
    encode_s: float
    decode_s: float


class CompressionPolicy:
    """``mode``, or in ``auto`` the codec each transfer's shape favours, judged by moving averages of each codec's
    ratio and speeds (``smoothing``: the newest sample's weight) over what transfers report."""

    def __init__(self, mode: str = Compression.AUTO.value, smoothing: float = 0.3) -> None:
        if mode not in MODES:
            raise ValueError(f"kv compression must be one of {', '.join(MODES)}, got {mode!r}")
        if type(smoothing) not in (int, float) or not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.mode, self.smoothing = mode, smoothing
        self.estimates: dict[str, CodecEstimate] = {}

    def observe(self, sample: CodecSample) -> None:
        """A codec's figures, measured: folded into its moving averages."""
        s = sample
        if s.codec == Compression.NONE or any(x <= 0 for x in (s.nbytes, s.wire_bytes, s.encode_s, s.decode_s)):
            return
        new = CodecEstimate(s.nbytes / s.wire_bytes, s.nbytes / s.encode_s, s.nbytes / s.decode_s)
        old = self.estimates.get(s.codec)
        if old is not None:
            w = self.smoothing
            new = CodecEstimate(*(w * n + (1 - w) * o for n, o in zip(astuple(new), astuple(old), strict=True)))
        self.estimates[s.codec] = new

    def choose(self, link: LinkShare, transfer: TransferShape = TransferShape(1.0)) -> CodecChoice:
        """The codec for ``transfer`` on ``link``; without a shape, the rule for a transfer with nothing to
        hide behind (which depends on the link and the codec only)."""
        mode = Compression(self.mode)
        expected = link.expected_bytes_per_s
        lossless = self.estimates.get(Compression.LOSSLESS)
        break_even = lossless.break_even_bps if lossless is not None else 0.0
        if mode is not Compression.AUTO:
            return CodecChoice(mode.value, "forced", break_even)
        if lossless is None:
            return CodecChoice(Compression.NONE, "unmeasured", break_even)
        if math.isinf(expected):
            return CodecChoice(Compression.NONE, "unlimited_link", break_even)
        if expected <= 0 or transfer.exposed_s(expected, lossless) < transfer.exposed_s(expected):
            return CodecChoice(Compression.LOSSLESS, "saves_time", break_even)
        return CodecChoice(Compression.NONE, "costs_more", break_even)
