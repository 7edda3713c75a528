"""The HTTP connection limit, kept on the server's protocol factory: each connection counted while it lives.

    site = loop.create_server(ConnectionLimit(factory, limit, metrics, RateLimitedLog(log)), host, port)

While ``limit`` are open a new one is answered 503 with Retry-After and an OpenAI error body at once, rather than
left in the kernel's queue, and closed once the client has read the answer. Reaching the limit is logged through
the ``RateLimitedLog`` (``http_server``), once a period with a count, not once per connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from minifaas.gateway.api_errors import APIError
from minifaas.gateway.metrics import ServeMetrics

LINGER_S = 2.0
RETRY_AFTER_S = 1
TOO_MANY = "too_many_connections"


class ConnectionLimit:
    """Wraps aiohttp's protocol factory so that each protocol it makes is counted while it lives."""

    def __init__(
        self, factory: Callable[[], asyncio.Protocol], limit: int, metrics: ServeMetrics, log: Callable[..., bool]
    ) -> None:
        self._factory, self.limit, self._metrics, self._log = factory, limit, metrics, log
        self.open = 0
        self.refused = 0
        self.lingering = 0
        self.max_lingering = max(16, limit // 8)
        error = APIError(503, f"The server holds {limit} connections, its limit; retry later.", code=TOO_MANY)
        payload = json.dumps(error.body()).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nRetry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n"
        )
        self.refusal = head.encode() + payload

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.limit:
            self.refused += 1
            self._metrics.request_error(TOO_MANY)
            self._log("full", logging.WARNING, f"{self.open} HTTP connections open, the limit: new ones get 503")
            return _Refusal(self)
        return _Counted(self._factory(), self)

    def opened(self) -> None:
        self.open += 1
        self._metrics.set_connections(self.open)

    def closed(self) -> None:
        self.open -= 1
        self._metrics.set_connections(self.open)


class _Counted(asyncio.Protocol):
    """The real protocol, with the count kept around its life."""

    def __init__(self, inner: asyncio.Protocol, limit: ConnectionLimit) -> None:
        self._inner, self._limit = inner, limit
        limit.opened()  # counted from now: the transport calls connection_made next

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._limit.closed()
        self._inner.connection_lost(exc)


class _Refusal(asyncio.Protocol):
    """A connection over the cap: the 503, then the close."""

    def __init__(self, limit: ConnectionLimit) -> None:
        self._limit = limit
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self._limit.refusal)
        if self._limit.lingering >= self._limit.max_lingering:
            transport.close()
            return
        self._limit.lingering += 1
        transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request it sent meanwhile is not read

    def eof_received(self) -> bool:
        return False  # the client has what it needs: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._limit.lingering -= 1
