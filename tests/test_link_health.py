"""Congestion signals: TCP_INFO from real sockets, the link monitor's arithmetic, and a real bottleneck."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time

import pytest
from netns import NETNS, SECRET_ENV, NetnsLink, run_pair, unavailable

from minifaas.net.connections import TcpInfo, read_tcp_info
from minifaas.net.link_health import LinkMonitor

pytestmark = pytest.mark.timeout(60)


def test_tcp_info_counts_what_a_real_socket_sent() -> None:
    payload = os.urandom(300_000)
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=10)
        peer, _ = server.accept()
        with client, peer:
            client.sendall(payload)
            got = 0
            peer.settimeout(10)
            while got < len(payload):
                got += len(peer.recv(1 << 20))
            deadline = time.monotonic() + 10  # acks are asynchronous: wait for the kernel to count them
            while (info := read_tcp_info(client)).bytes_acked < len(payload) + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
    assert info.bytes_acked == len(payload) + 1  # the kernel counts the SYN as one byte
    assert info.bytes_sent >= len(payload)
    assert info.rtt_us > 0 and info.delivery_rate > 0 and info.total_retrans == 0


def sample(acked: int, sent: int, retrans: int = 0, rtt_us: int = 1000) -> TcpInfo:
    zero = {f.name: 0 for f in dataclasses.fields(TcpInfo)}
    return TcpInfo(**{**zero, "bytes_acked": acked, "bytes_sent": sent, "bytes_retrans": retrans, "rtt_us": rtt_us})


def test_monitor_turns_counter_growth_into_goodput_and_loss() -> None:
    monitor = LinkMonitor(link_rate_bps=100e6)
    first = monitor.update(10.0, {1: sample(0, 0), 2: sample(0, 0)})
    assert first.goodput_bps == 0 and first.connections == 2
    second = monitor.update(
        11.0, {1: sample(5_000_000, 5_100_000, 100_000, 2000), 2: sample(1_250_000, 1_250_000)}, queued_bytes=77
    )
    assert second.goodput_bps == pytest.approx(8 * 6_250_000)
    assert second.utilisation == pytest.approx(0.5)
    assert second.retrans_rate == pytest.approx(100_000 / 6_350_000)
    assert second.rtt_ms == pytest.approx(1.5) and second.queued_bytes == 77


def test_monitor_ignores_a_connection_until_its_second_sample() -> None:
    monitor = LinkMonitor(link_rate_bps=1e9)
    monitor.update(0.0, {1: sample(100, 100)})
    reading = monitor.update(1.0, {1: sample(200, 200), 9: sample(10**9, 10**9)})
    assert reading.goodput_bps == pytest.approx(800)


@pytest.mark.root
@pytest.mark.skipif((reason := unavailable()) is not None, reason=str(reason))
def test_a_real_bottleneck_shows_loss_and_retransmissions() -> None:
    env = {**os.environ, SECRET_ENV: "netns-test-secret-0123456789"}
    with NetnsLink(rate="20mbit", queue_bytes=16_000) as link:
        probe = [sys.executable, NETNS, "probe", "--bytes", str(3 << 20), "--connections",
                 "4", "--rate", "20mbit"]  # fmt: skip
        lines = run_pair(link, probe, env, timeout=45)
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    readings = [line["health"] for line in lines if "health" in line]
    assert lines[-1]["done"]["bytes"] >= 3 << 20
    assert readings and max(r["goodput_bps"] for r in readings) > 0
    assert readings[-1]["total_retrans"] > 0  # a queue of ~10 packets overflowed: real loss, real retransmits
    assert link.namespaces["a"] in namespaces  # (it existed while in use)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert link.namespaces["a"] not in after and link.namespaces["b"] not in after
