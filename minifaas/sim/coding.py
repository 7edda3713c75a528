"""KV compression in the simulator: the live policy picks each transfer's codec, the flow shrinks by its ratio.

Each PrfaaS transfer asks the codec policy (``policy.codec_policy``, or a plug-in) for a codec with the link as
the simulator sees it when the transfer is placed (its rate, the short-term
scheduler's smoothed utilisation when one runs, the flows on the pipe) and
the transfer's shape (its bytes, its prefill time, and, when layers stream,
one layer's bytes as the tail that waits for the prefill's end). A coded flow
enters the pipe at its coded size, and its KV lands later by the time coding
the tail takes at both ends (the rest is coded as it streams): the cost the
policy weighs. The codec figures are given (``SimConfig.codecs``), not
measured: the simulator has no bytes to code; the policy is told them once, as a measurement.
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
        self.state_bytes = 0.0
        self.wire_bytes = 0.0

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
