"""Heartbeats with a deadline: the client side of a supervised control session.

``Heartbeat`` is the sans-IO rule: ping every ``interval_s``; the peer is late
once nothing at all (a pong or any other message) was heard for
``deadline_s``. ``keep_alive`` drives it over a live session: it sends the
pings, hands every message on, and returns SessionLost the moment the peer is
late, the connection ends or a frame is forged, so the caller takes the peer
out of service at once.

The deadline is several intervals (5 s over 1 s by default): a busy host may
delay one pong by a second or two, and dropping a healthy worker costs every
request it holds a fallback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from minifaas.control.session import ControlError, Session, SessionLost


@dataclass(frozen=True, slots=True)
class HeartbeatConfig:
    interval_s: float = 1.0
    deadline_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.interval_s < self.deadline_s:
            raise ValueError(f"need 0 < interval_s < deadline_s, got {self.interval_s}, {self.deadline_s}")


class Heartbeat:
    """When to ping and when the peer is late. Time is passed in."""

    def __init__(self, config: HeartbeatConfig, now: float) -> None:
        self.config = config
        self.last_heard = now
        self.last_ping = now - config.interval_s  # the first ping is due at once

    def heard(self, now: float) -> None:
        self.last_heard = max(self.last_heard, now)

    def pinged(self, now: float) -> None:
        self.last_ping = now

    def ping_due(self, now: float) -> bool:
        return now - self.last_ping >= self.config.interval_s

    def late(self, now: float) -> bool:
        return now - self.last_heard > self.config.deadline_s

    def deadline_left(self, now: float) -> float:
        return max(0.0, self.config.deadline_s - (now - self.last_heard))


async def keep_alive(
    session: Session, config: HeartbeatConfig, on_message: Callable[[dict], None], ping: Callable[[], dict]
) -> SessionLost:
    """Ping and listen until the session is lost; every message goes to ``on_message``. Returns why it ended."""
    loop = asyncio.get_running_loop()
    beat = Heartbeat(config, loop.time())

    async def pinging() -> None:
        while True:
            if beat.ping_due(loop.time()):
                session.send(ping())
                beat.pinged(loop.time())
                await session.drain(config.deadline_s)
            await asyncio.sleep(max(0.0, beat.last_ping + config.interval_s - loop.time()))

    async def listening() -> None:
        while True:
            message = await session.recv(timeout=beat.deadline_left(loop.time()) or 0.001)
            if message is None:
                raise SessionLost(f"{session.peer} closed the session")
            beat.heard(loop.time())
            on_message(message)

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(pinging())
            tg.create_task(listening())
    except BaseExceptionGroup as group:
        lost, rest = group.split(ControlError)
        if rest is not None or lost is None:
            raise
        error = lost.exceptions[0]
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        return error if isinstance(error, SessionLost) else SessionLost(f"{type(error).__name__}: {error}")
    finally:
        session.close()
    raise AssertionError("both loops run until the session fails")  # pragma: no cover
