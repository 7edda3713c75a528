"""KV compression in the simulator: the live codec policy picks each PrfaaS transfer's codec as it is placed.

A coded flow enters the link at its coded size, and its KV lands later by the time coding its tail takes at both
ends. The codec figures are given (``SimConfig.codecs``): the simulator has no bytes to code, so the policy is
told them once, as if measured.
"""

from __future__ import annotations

from collections import Counter

from minifaas.policy.codec_policy import MODES, CodecEstimate, CodecSample, CompressionPolicy, LinkShare, TransferShape
from minifaas.policy.interfaces import CodecPolicy
from minifaas.policy.plugin import CODEC, Args, building, load_policy

MEASURED_BYTES = 1e9  # the size of the one measurement each codec's figures are told as


class SimCoding:
    def __init__(self, mode: str, codecs: tuple[tuple[str, CodecEstimate], ...], args: Args = ()) -> None:
        with building(CODEC, mode):
            self.policy: CodecPolicy = (
                CompressionPolicy(**{"mode": mode, **dict(args)}) if mode in MODES else load_policy(mode, CODEC, args)
            )
        self.codecs = dict(codecs)
        for codec, e in codecs:
            n = MEASURED_BYTES
            self.policy.observe(CodecSample(codec, n, n / e.ratio, n / e.encode_bps, n / e.decode_bps))
        self.chosen: Counter[str] = Counter()
        self.state_bytes = self.wire_bytes = 0.0

    def transfer(self, shape: TransferShape, rate_bps: float, utilisation: float, flows: int) -> tuple[float, float]:
        """Bytes on the wire and seconds of coding after the last byte, for a transfer placed now."""
        choice = self.policy.choose(LinkShare(rate_bps, utilisation, flows), shape)
        self.chosen[choice.codec] += 1
        estimate = self.codecs.get(choice.codec)
        nbytes = shape.nbytes
        wire, seconds = nbytes, 0.0
        if estimate is not None and choice.codec != "none":
            wire = nbytes / estimate.ratio
            seconds = shape.tail / estimate.encode_bps + shape.tail / estimate.decode_bps
        self.state_bytes += nbytes
        self.wire_bytes += wire
        return wire, seconds

    @property
    def coded_fraction(self) -> float:
        total = sum(self.chosen.values())
        return (total - self.chosen["none"]) / total if total else 0.0

    @property
    def ratio(self) -> float:
        return self.state_bytes / self.wire_bytes if self.wire_bytes else 1.0
