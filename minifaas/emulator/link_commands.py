"""The link emulator's control commands (listed in ``emulator_server``), each checked in full before it acts.

Everything a command carries is bounded, and a route leads only to a host the emulator was started for: the
control port can reshape the link it guards, never turn the emulator into a relay to anywhere.
"""

from __future__ import annotations

import itertools
from typing import Any

from minifaas.emulator.pacer import RateSchedule, check_window
from minifaas.emulator.relay import LinkEmulator

MAX_RATE_BPS = 1e13  # 10 Tbit/s: beyond any link the emulator can relay
MAX_STALL_S = 600.0
MAX_DELAY_MS = 10_000.0
MAX_STEPS = 1000
MAX_SCHEDULE_S = 86_400.0
MAX_ROUTES = 64


class CommandError(ValueError):
    """A control command the emulator refuses; the message says why."""


def _number(request: dict[str, Any], key: str, low: float, high: float) -> float:
    value = request.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise CommandError(f"{key} must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def check_rate(value: object, key: str = "bps") -> float | None:
    """A rate in bits/s: > 0 and at most MAX_RATE_BPS, or None (unlimited)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_RATE_BPS:
        raise CommandError(f"{key} must be null or a rate in (0, {MAX_RATE_BPS:g}] bit/s, got {value!r}")
    return float(value)


def _schedule(steps: object) -> RateSchedule:
    if not isinstance(steps, list) or not 0 < len(steps) <= MAX_STEPS:
        raise CommandError(f"steps must be a list of 1 to {MAX_STEPS} [seconds, rate] pairs")
    out = []
    for step in steps:
        if not isinstance(step, list) or len(step) != 2:
            raise CommandError(f"a step is [seconds, rate], got {step!r}")
        at = _number({"seconds": step[0]}, "seconds", 0.0, MAX_SCHEDULE_S)
        out.append((at, check_rate(step[1], "a step's rate")))
    if any(b[0] < a[0] for a, b in itertools.pairwise(out)):
        raise CommandError("steps must be in time order")
    return RateSchedule(tuple(out))


def _route_target(link: LinkEmulator, text: object, hosts: frozenset[str]) -> tuple[str, int]:
    host, _, port = str(text).rpartition(":")
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise CommandError(f"not HOST:PORT: {text!r}")
    if host not in hosts:
        raise CommandError(f"routes lead only to {', '.join(sorted(hosts))}, not {host!r}")
    if len(link.routes) >= MAX_ROUTES:
        raise CommandError(f"at most {MAX_ROUTES} routes")
    return host, int(port)


def apply_command(link: LinkEmulator, request: dict[str, Any], route_hosts: frozenset[str]) -> dict[str, Any]:
    """Carry out one command and return the reply's fields; raises CommandError, leaving the link as it was."""
    cmd = request.get("cmd")
    if cmd == "stats":
        return link.stats()
    if cmd == "ping":
        return {}
    if cmd == "cut":
        link.cut()
    elif cmd == "stall":
        link.stall(_number(request, "seconds", 0.0, MAX_STALL_S))
    elif cmd == "corrupt":
        link.corrupt_pending += 1
    elif cmd == "rate":
        if not {"bps", "flow_bps"} & request.keys():
            raise CommandError("rate takes bps, flow_bps or both")
        rates = {key: check_rate(request[key], key) for key in ("bps", "flow_bps") if key in request}
        if "bps" in rates:
            link.set_rate(rates["bps"])
        if "flow_bps" in rates:
            link.set_flow_rate(rates["flow_bps"])
    elif cmd == "window":
        try:
            window = check_window(request.get("bytes"))
        except ValueError as e:
            raise CommandError(str(e)) from None
        if window is not None and window > 1 << 32:
            raise CommandError(f"a window of at most 4 GiB, got {window}")
        link.set_window(window)
    elif cmd == "delay":
        ms = _number(request, "ms", 0.0, MAX_DELAY_MS)
        link.set_delay(ms, _number({"jitter_ms": request.get("jitter_ms", 0.0)}, "jitter_ms", 0.0, ms))
    elif cmd == "schedule":
        link.set_schedule(_schedule(request.get("steps")))
    elif cmd == "route":
        return {"port": link.add_route(*_route_target(link, request.get("target"), route_hosts))}
    elif cmd == "unroute":
        port = request.get("port")
        if isinstance(port, bool) or port not in link.routes:
            raise CommandError(f"no route listens on port {port!r}")
        link.remove_route(port)
    else:
        raise CommandError(f"unknown command {cmd!r}")
    return {}
