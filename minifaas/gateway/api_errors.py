"""The errors a client sees: ``APIError`` (an HTTP status and OpenAI error body), the one each failure of a request
becomes, its cause in ``minifaas:request_errors``, its aiohttp response; and the raw 503 of a connection past the
server's limit (``Refusals``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.migration import MigrationLimit, PoisonRequest
from minifaas.gateway.requests import DeadlineExceeded, Overloaded, RequestFailed

RETRY_AFTER_S = "1"
LINGER_S = 2.0  # a refused connection is closed this long after its 503, or when the client closes first
TOO_MANY = "too_many_connections"
# the metric cause of an error whose body has no code
_CAUSES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class APIError(Exception):
    """An error the client caused or must see, with the HTTP status and OpenAI error body it maps to."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "",
        retry_after: int | None = None,  # seconds, for the Retry-After header of a 503
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def api_error(e: Exception) -> APIError:
    """The OpenAI error a failure of the gateway's stream becomes."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, Overloaded):
        message = str(e) or "The server is overloaded; retry later."
        return APIError(503, message, code="overloaded", retry_after=e.retry_after)
    if isinstance(e, MigrationLimit):
        return APIError(503, str(e), code="migration_limit")
    if isinstance(e, PoisonRequest):
        return APIError(500, str(e), code="poison_request")
    if isinstance(e, DeadlineExceeded):
        return APIError(504, str(e), code="timeout")
    if isinstance(e, RequestFailed):
        return APIError(500, str(e), code="request_failed")
    return APIError(500, f"Internal error ({type(e).__name__}); the request was not completed.", code="internal_error")


def cause_of(error: APIError) -> str:
    """The error's cause in ``minifaas:request_errors``: its body's code, else one for its status."""
    return error.code or _CAUSES.get(error.status, f"http_{error.status}")


def error_response(error: APIError, metrics: ServeMetrics) -> web.Response:
    """The error's JSON response, counted by cause."""
    metrics.request_error(cause_of(error))
    response = web.json_response(error.body(), status=error.status)
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(error.retry_after)
    if error.status == 408:  # the body is still coming: close rather than read the rest
        response.force_close()
    return response


class Refusals:
    """Makes the protocol of each connection past ``limit``: a 503 with Retry-After at once, then the close once the
    client has read it (at most ``max_lingering`` wait for that at a time); the request it sent is not read."""

    def __init__(self, limit: int) -> None:
        error = APIError(503, f"The server holds {limit} connections, its limit; retry later.", code=TOO_MANY)
        payload = json.dumps(error.body()).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nRetry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n"
        )
        self.answer = head.encode() + payload
        self.lingering = 0
        self.max_lingering = max(16, limit // 8)

    def __call__(self) -> asyncio.Protocol:
        return _Refusal(self)


class _Refusal(asyncio.Protocol):
    def __init__(self, refusals: Refusals) -> None:
        self._refusals = refusals
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self._refusals.answer)
        if self._refusals.lingering >= self._refusals.max_lingering:
            transport.close()
            return
        self._refusals.lingering += 1
        transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._refusals.lingering -= 1
