"""Authenticated connections to one receiver, dialled once and reused between transfers.

A transfer borrows connections for its whole life and gives them back only if
it ended cleanly (a connection that broke mid-frame is closed, never reused).
Every live connection, idle or busy, is listed so link health can sample its
TCP_INFO.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from dataclasses import dataclass
from itertools import count

from minifaas.transport.auth import prove_as_sender
from minifaas.transport.channel import Channel, open_channel


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    secret: bytes
    connect_timeout: float = 5.0
    unsent_limit: int | None = None


class ConnectionPool:
    def __init__(self, endpoint: Endpoint, max_idle: int, ssl: ssl_module.SSLContext | None = None):
        self.endpoint = endpoint
        self.max_idle = max_idle
        self._ssl = ssl
        self._idle: list[Channel] = []
        self.live: dict[int, Channel] = {}  # connection id -> channel
        self._ids = count()
        self.dialled = 0

    async def acquire(self, n: int) -> list[Channel]:
        """``n`` connections: idle ones first, the rest dialled in parallel."""
        while self._idle and self._idle[-1].closed:
            self._idle.pop()
        taken = [self._idle.pop() for _ in range(min(n, len(self._idle)))]
        dials: list[asyncio.Task[Channel]] = []
        try:
            async with asyncio.TaskGroup() as tg:
                dials.extend(tg.create_task(self._dial()) for _ in range(n - len(taken)))
        except BaseExceptionGroup as eg:
            dialled = [t.result() for t in dials if t.done() and not t.cancelled() and t.exception() is None]
            for channel in taken + dialled:
                self.release(channel)
            raise eg.exceptions[0] from None
        return taken + [task.result() for task in dials]

    async def _dial(self) -> Channel:
        e = self.endpoint
        channel = await open_channel(e.host, e.port, e.connect_timeout, self._ssl, e.unsent_limit)
        try:
            await prove_as_sender(channel, e.secret, e.connect_timeout)
        except BaseException:
            channel.close(reset=True)
            raise
        self.dialled += 1
        self.live[next(self._ids)] = channel
        return channel

    def release(self, channel: Channel) -> None:
        if channel.closed or len(self._idle) >= self.max_idle:
            self.discard(channel)
        else:
            self._idle.append(channel)

    def discard(self, channel: Channel, reset: bool = False) -> None:
        channel.close(reset=reset)
        for key, ch in list(self.live.items()):
            if ch is channel:
                del self.live[key]

    def close(self) -> None:
        for channel in list(self.live.values()):
            self.discard(channel)
        self._idle.clear()
