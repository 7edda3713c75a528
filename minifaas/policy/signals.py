"""What the scheduler sees: one sample of the link, the stage queues and the traffic, taken on a tick.

The gateway fills it from the link and its workers, the simulator from its own; the policies read nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StageLoad:
    """One stage (PrfaaS prefill, PD-P prefill, PD-D decode) at sampling time."""

    nodes: int  # instances serving the stage now (draining ones excluded)
    depth: int = 0  # requests placed there and not done (running and waiting)
    wait_s: float = 0.0  # how long a request arriving now would wait before it starts

    def __post_init__(self) -> None:
        if self.nodes < 0 or self.depth < 0 or self.wait_s < 0:
            raise ValueError(f"bad stage load {self}")

    @property
    def per_node(self) -> float:
        """Requests per serving node; 0 with none serving (the router already routes around it)."""
        return self.depth / self.nodes if self.nodes else 0.0


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One prefill that ended: ``tokens`` computed on ``cluster`` ("prfaas" or "pd") in ``seconds``."""

    cluster: str
    tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Signals:
    now_s: float
    link_rate_bps: float  # the PrfaaS egress ceiling now (0: the link is cut)
    egress_bps: float  # PrfaaS egress goodput since the previous sample
    prfaas: StageLoad
    pd_prefill: StageLoad
    decode: StageLoad
    rtt_ms: float = 0.0  # smoothed rtt of the KV connections; 0 when not measured
    retrans_rate: float = 0.0  # retransmitted / sent bytes since the previous sample
    link_backlog_s: float = 0.0  # KV bytes waiting for the link / its rate: the wait a new transfer sees
    decode_occupancy: float = 0.0  # running decode slots / all decode slots
    lengths: tuple[int, ...] = ()  # incremental prefill lengths routed since the previous sample
    prefills: tuple[PrefillSample, ...] = ()  # prefills measured since the previous sample (the live gateway's)
    output_tokens: tuple[int, ...] = ()  # completion tokens of the requests finished since the previous sample

    def __post_init__(self) -> None:
        if self.link_rate_bps < 0 or self.egress_bps < 0 or self.rtt_ms < 0 or not 0 <= self.retrans_rate <= 1:
            raise ValueError(f"bad link signals {self}")

    @property
    def utilisation(self) -> float:
        """Egress over the ceiling; a cut link counts as full."""
        return self.egress_bps / self.link_rate_bps if self.link_rate_bps > 0 else 1.0
