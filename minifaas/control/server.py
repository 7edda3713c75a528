"""A control port that serves one client at a time: authenticate it, refuse a second, drop a silent one.

    async with ControlServer(("0.0.0.0", 7000), secret, handle) as server:
        ...                      # handle(session) runs for the one client attached

Handshakes are bounded in time and number, so no peer can hold the port. Whatever the handler raises ends that
session only; the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module
import time
from collections.abc import Awaitable, Callable

from minifaas.control.session import MAX_BYTES, ControlError, Message, Session, Why, accept

log = logging.getLogger("minifaas.control")
LOG_EVERY_S = 10.0


class Taken(Message, tag="refused"):
    """The answer to a client that would attach while another is attached."""

    error: Why


class ControlServer:
    def __init__(
        self,
        listen: tuple[str, int],
        secret: bytes,
        handler: Callable[[Session], Awaitable[None]],
        ssl: ssl_module.SSLContext | None = None,
        deadline_s: float = 30.0,
        handshake_timeout: float = 5.0,
        max_pending: int = 8,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        if min(deadline_s, handshake_timeout) <= 0 or max_pending < 1:
            raise ValueError("need positive deadlines and max_pending >= 1")
        self.listen, self.secret, self.handler, self.ssl = listen, secret, handler, ssl
        self.deadline_s, self.handshake_timeout = deadline_s, handshake_timeout
        self.max_pending, self.max_bytes = max_pending, max_bytes
        self.active: Session | None = None
        self.sessions = 0  # served so far
        self.refused = 0  # connections turned away, for whatever reason
        self._pending = 0
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self._logged_at = -LOG_EVERY_S
        self._unlogged = 0

    @property
    def port(self) -> int:
        assert self._server is not None, "the server is not running"
        return self._server.sockets[0].getsockname()[1]

    async def __aenter__(self) -> ControlServer:
        host, port = self.listen
        tls_timeout = self.handshake_timeout if self.ssl else None
        self._server = await asyncio.start_server(
            self._connection, host, port, ssl=self.ssl, ssl_handshake_timeout=tls_timeout
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # owned: cancelled and awaited when the server closes
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:  # the server is closing; asyncio would log the cancelled task as an error
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._pending >= self.max_pending:
            self._refuse(f"{self.max_pending} connections are already authenticating")
            return
        self._pending += 1
        try:
            session = await accept(reader, writer, self.secret, self.handshake_timeout, self.max_bytes)
        except ControlError as e:
            self._refuse(str(e))
            return
        finally:
            self._pending -= 1
        if self.active is not None:
            with contextlib.suppress(ControlError):
                session.send(Taken(error=f"another client ({self.active.peer}) is attached"))
                await session.drain(self.handshake_timeout)
            self._refuse(f"{session.peer} while {self.active.peer} is attached")
            return
        self.active, self.sessions = session, self.sessions + 1
        log.info("control: %s attached", session.peer)
        try:
            await self.handler(session)
        except ControlError as e:
            log.warning("control: session with %s ended: %s", session.peer, e)
        except Exception:  # a bug in the handler: it ends this session, never the server
            log.exception("control: the session with %s failed", session.peer)
        finally:
            session.close()
            self.active = None
            log.info("control: %s detached", session.peer)

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning("control: refused a connection (%d since the last report): %s", self._unlogged, why)
            self._logged_at, self._unlogged = now, 0
