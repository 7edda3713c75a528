"""KV compression in the simulator: the live policy picks each transfer's codec, the flow shrinks by its ratio.

Each PrfaaS transfer asks ``policy.compression`` for a codec with the link as
the simulator sees it when the transfer is placed (its rate, the short-term
scheduler's smoothed utilisation when one runs, the flows on the pipe). A
coded flow enters the pipe at its coded size, and its KV lands later by the
full coding time, encode plus decode, charged after the last byte: the same
serial cost the policy weighs, so the simulator is pessimistic about coding
exactly where the rule is. The codec figures are given (``SimConfig.codecs``),
not measured: the simulator has no bytes to code.
"""

from __future__ import annotations

from collections import Counter

from minifaas.policy.compression import CodecEstimate, CompressionConfig, CompressionPolicy, LinkShare


class SimCoding:
    def __init__(self, mode: str, codecs: tuple[tuple[str, CodecEstimate], ...]) -> None:
        self.policy = CompressionPolicy(CompressionConfig(mode))
        self.policy.meter.estimates.update(dict(codecs))
        self.chosen: Counter[str] = Counter()
        self.state_bytes = 0.0
        self.wire_bytes = 0.0

    def transfer(self, nbytes: float, rate_bps: float, utilisation: float, flows: int) -> tuple[float, float]:
        """Bytes on the wire and seconds of coding for a transfer of ``nbytes`` of state placed now."""
        choice = self.policy.choose(LinkShare(rate_bps, utilisation, flows))
        self.chosen[choice.codec] += 1
        estimate = self.policy.meter.estimates.get(choice.codec)
        wire, seconds = nbytes, 0.0
        if estimate is not None and choice.codec != "none":
            wire = nbytes / estimate.ratio
            seconds = nbytes / estimate.encode_bps + nbytes / estimate.decode_bps
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
