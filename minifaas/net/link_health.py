"""Congestion signals: the kernel's TCP_INFO per sender connection, folded into one link reading.

``LinkMonitor`` is sans-IO: given samples and the time, it turns the growth of the kernel's counters into a
``LinkHealth`` (goodput, utilisation, rtt, retransmissions, queued bytes) for the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from minifaas.net.connections import TcpInfo


@dataclass(frozen=True, slots=True)
class LinkHealth:
    goodput_bps: float  # bits/s acknowledged by the peer since the previous reading
    utilisation: float  # goodput / configured link rate
    rtt_ms: float  # mean smoothed rtt over connections
    rttvar_ms: float
    retrans_rate: float  # retransmitted / sent bytes since the previous reading
    total_retrans: int  # segments retransmitted, over the connections' lives
    unsent_bytes: int  # in the kernels' send queues, not yet sent
    queued_bytes: int  # in the sender's own queue
    delivery_rate_bps: float  # sum of the kernel's per-connection estimates
    connections: int


class LinkMonitor:
    """Turns successive TCP_INFO samples into link readings. Time is passed in."""

    def __init__(self, link_rate_bps: float):
        if link_rate_bps <= 0:
            raise ValueError("the configured link rate must be positive")
        self.link_rate_bps = link_rate_bps
        self._last: dict[int, TcpInfo] = {}
        self._last_time: float | None = None

    def update(self, now: float, infos: dict[int, TcpInfo], queued_bytes: int = 0) -> LinkHealth:
        acked = sent = retrans = 0
        for key, info in infos.items():
            before = self._last.get(key)
            if before is not None:  # a connection seen for the first time contributes from now on
                acked += info.bytes_acked - before.bytes_acked
                sent += info.bytes_sent - before.bytes_sent
                retrans += info.bytes_retrans - before.bytes_retrans
        elapsed = None if self._last_time is None else now - self._last_time
        goodput = 8 * acked / elapsed if elapsed else 0.0
        self._last, self._last_time = dict(infos), now
        n = len(infos)
        return LinkHealth(
            goodput_bps=goodput,
            utilisation=goodput / self.link_rate_bps,
            rtt_ms=sum(i.rtt_us for i in infos.values()) / n / 1000 if n else 0.0,
            rttvar_ms=sum(i.rttvar_us for i in infos.values()) / n / 1000 if n else 0.0,
            retrans_rate=retrans / sent if sent else 0.0,
            total_retrans=sum(i.total_retrans for i in infos.values()),
            unsent_bytes=sum(i.notsent_bytes for i in infos.values()),
            queued_bytes=queued_bytes,
            delivery_rate_bps=8.0 * sum(i.delivery_rate for i in infos.values()),
            connections=n,
        )
