"""Heartbeats with a deadline: the client side of a supervised control session.

``Heartbeat`` is the sans-IO rule: ping every ``interval_s``; the peer is late once a ping has gone unanswered
for ``deadline_s``. Counting from the ping means a client whose own loop stalled does not blame its peers.
``keep_alive`` drives the rule over a live session and returns SessionLost as soon as the peer is late or gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from minifaas.control.session import ControlError, PeerSilent, Session, SessionLost


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
        self.unanswered_since: float | None = None  # the first ping sent since the peer was last heard

    def heard(self, now: float) -> None:
        self.last_heard = max(self.last_heard, now)
        self.unanswered_since = None

    def pinged(self, now: float) -> None:
        self.last_ping = now
        if self.unanswered_since is None:
            self.unanswered_since = now

    def ping_due(self, now: float) -> bool:
        return now - self.last_ping >= self.config.interval_s

    def late(self, now: float) -> bool:
        return self.unanswered_since is not None and now - self.unanswered_since > self.config.deadline_s

    def deadline_left(self, now: float) -> float:
        if self.unanswered_since is None:
            return self.config.deadline_s
        return max(0.0, self.config.deadline_s - (now - self.unanswered_since))


async def keep_alive(
    session: Session, config: HeartbeatConfig, on_message: Callable[[dict], None], ping: Callable[[], object]
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
        while (message := await session.recv()) is not None:
            beat.heard(loop.time())
            on_message(message)
        raise SessionLost(f"{session.peer} closed the session")

    async def watching() -> None:
        while True:
            await asyncio.sleep(max(beat.deadline_left(loop.time()), 0.01))
            for _ in range(2):  # after a stall of this loop, let the listener take what already arrived
                await asyncio.sleep(0)
            if beat.late(loop.time()):
                raise PeerSilent(f"{session.peer} did not answer a ping within {config.deadline_s} s")

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(pinging())
            tg.create_task(listening())
            tg.create_task(watching())
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
    raise AssertionError("the loops run until the session fails")  # pragma: no cover
