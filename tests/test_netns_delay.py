"""A namespace link with a round trip and a window: the delay process on the return path, seen by the kernel's TCP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from netns import NETNS, NETNS_DELAY, SECRET_ENV, NetnsLink, run_pair, unavailable

DELAY = [sys.executable, NETNS_DELAY]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tun", "t", "--out", "o", "--to", "zz", "--delay-ms", "5"], "not a MAC address"),
        (["--tun", "t", "--out", "o", "--to", "02:00:00:00:00:01", "--delay-ms", "0"], "--delay-ms must be in"),
    ],
)
def test_the_delay_process_refuses_bad_arguments(argv: list[str], message: str) -> None:
    done = subprocess.run([*DELAY, *argv], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and message in done.stderr


def test_a_namespace_link_refuses_a_bad_window_or_round_trip() -> None:
    with pytest.raises(ValueError, match="whole number of bytes"):
        NetnsLink(window_bytes=100)
    with pytest.raises(ValueError, match="rtt_ms"):
        NetnsLink(rtt_ms=-1)


@pytest.mark.root
@pytest.mark.skipif((reason := unavailable()) is not None, reason=str(reason))
def test_the_kernels_tcp_sees_the_round_trip_and_keeps_one_window_in_flight() -> None:
    env = {**os.environ, SECRET_ENV: "netns-test-secret-0123456789"}
    window, rtt_ms, nbytes = 57_000, 30.0, 6 << 20
    with NetnsLink(rate="50mbit", queue_bytes=64_000, burst_bytes=16_000, rtt_ms=rtt_ms, window_bytes=window) as link:
        probe = [sys.executable, NETNS, "probe", "--bytes", str(nbytes), "--connections",
                 "1", "--rate", "50mbit", "--warm-up"]  # fmt: skip
        lines = run_pair(link, probe, env, timeout=60)
        delay = link._delay
    rtts = [line["health"]["rtt_ms"] for line in lines if "health" in line and line["health"]["rtt_ms"]]
    done = lines[-1]["done"]
    assert rtts and min(rtts) >= rtt_ms * 0.95  # the kernel's own smoothed RTT: the delay is on its path
    assert done["bytes"] >= nbytes
    # one connection keeps about one window in flight per round trip (15 Mbit/s; the kernel keeps the
    # window it advertises a little above the clamp): half the link at most, where it gets 40+ without one
    assert 8 * done["bytes"] / done["seconds"] <= 0.5 * 50e6
    assert delay is not None and delay.poll() is not None  # the delay process ended with the link
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert link.namespaces["a"] not in after and link.namespaces["b"] not in after
