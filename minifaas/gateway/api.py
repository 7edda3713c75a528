"""The OpenAI-compatible HTTP edge of a completion: its connection counted (or refused past the limit), its errors
as OpenAI bodies, its key checked, its body read and parsed, its tokens sent back whole or streamed (``sse``).

Rules and response shapes live in openai_schema, generation in the gateway, the routes in ``http_server``. A
client that goes away aborts its request on every worker; one cut at shutdown (``http_server.finish``) ends
with a 503 or, in a stream, an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from aiohttp import web

from minifaas.config import HttpConfig
from minifaas.gateway.api_errors import RETRY_AFTER_S, TOO_MANY, APIError, Refusals, api_error, error_response
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.openai_schema import APIEndpoint, CompletionReply, ParsedRequest, check_finished, parse_request
from minifaas.gateway.requests import GenerateRequest, Overloaded, RequestFailed, RequestRecord, TokenEvent
from minifaas.gateway.sse import CUT, stream_reply
from minifaas.model.tokenizer import Tokenizer

log = logging.getLogger("minifaas.api")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
PARSE_ON_LOOP_BYTES = 64 << 10  # a larger body is tokenized on a thread of its own: seconds, at megabytes


class GatewayAPI(Protocol):
    """What the HTTP layer needs from the gateway."""

    model_name: str
    tokenizer: Tokenizer
    max_context: int

    def stream(self, request: GenerateRequest, record: RequestRecord) -> AsyncIterator[TokenEvent]:
        """Token events until one carries a finish_reason. Closing the iterator early aborts the request."""
        ...

    def health(self) -> dict: ...


def openai_errors(metrics: ServeMetrics) -> Middleware:
    """Every error as an OpenAI error body, counted by cause; every 503 with Retry-After."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except APIError as e:
            response = error_response(e, metrics)
        except web.HTTPException as e:  # aiohttp's own 404, 405, ...
            if e.status < 400:
                raise
            response = error_response(APIError(e.status, e.reason), metrics)
            if "Allow" in e.headers:  # a 405 says which methods the path takes
                response.headers["Allow"] = e.headers["Allow"]
        except Exception as e:  # a bug: the client still gets JSON, the log the trace
            log.exception("%s %s failed", request.method, request.path)
            response = error_response(api_error(e), metrics)
        if response.status == 503:  # /health's too
            response.headers.setdefault("Retry-After", RETRY_AFTER_S)
        return response

    return errors


def bearer_auth(api_key: str | None) -> Middleware:
    """/v1 takes ``Authorization: Bearer KEY``, the scheme in any case (as HTTP has it)."""
    expected = api_key.encode() if api_key else None

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path.startswith("/v1"):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            key = given.strip(" ").encode(errors="surrogateescape")  # a header's odd bytes come as surrogates
            if scheme.lower() != "bearer" or not hmac.compare_digest(key, expected):
                raise APIError(401, "Invalid or missing API key.", code="invalid_api_key")
        return await handler(request)

    return check


class OpenAIServer:
    def __init__(self, gateway: GatewayAPI, metrics: ServeMetrics, http: HttpConfig) -> None:
        self.gateway = gateway
        self.metrics = metrics
        self.http = http
        self._parser = ThreadPoolExecutor(1, thread_name_prefix="parse")  # one large body at a time
        self.running: set[asyncio.Task[object]] = set()  # the requests being answered
        self.cutting = False  # the grace is over: requests cancelled now end with ``CUT``

    async def close(self, app: web.Application) -> None:
        self._parser.shutdown(wait=False, cancel_futures=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, APIEndpoint.COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, APIEndpoint.CHAT)

    async def _read_body(self, request: web.Request) -> bytes:
        limit, seconds = self.http.max_body_bytes, self.http.body_timeout
        try:
            async with asyncio.timeout(seconds):
                if request.content_length is None or request.content_length <= limit:
                    return await request.read()  # bounded by the app's client_max_size, chunked bodies included
        except web.HTTPRequestEntityTooLarge:
            pass
        except TimeoutError:
            raise APIError(408, f"The request body did not arrive within {seconds:g} s.", code="body_timeout") from None
        raise APIError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")

    def _parse(self, endpoint: APIEndpoint, raw: bytes) -> ParsedRequest:
        gateway = self.gateway
        return parse_request(endpoint, raw, model_name=gateway.model_name, tokenizer=gateway.tokenizer,
                             max_context=gateway.max_context)  # fmt: skip

    async def _generate(self, request: web.Request, endpoint: APIEndpoint) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            raw = await self._read_body(request)
            if len(raw) <= PARSE_ON_LOOP_BYTES:
                parsed = self._parse(endpoint, raw)
            else:  # the other clients' streams go on meanwhile
                parsed = await asyncio.get_running_loop().run_in_executor(self._parser, self._parse, endpoint, raw)
        except APIError:
            self.metrics.request_finished(None, "invalid")
            raise
        reply = CompletionReply.start(
            endpoint, self.gateway.model_name, parsed.prompt_ids, started, parsed.return_token_ids
        )
        outcome, task = "error", asyncio.current_task()
        assert task is not None
        self.running.add(task)
        try:
            with self.metrics.running.track_inprogress():
                generate = GenerateRequest(reply.id, parsed.prompt_ids, parsed.sampling)
                events = self.gateway.stream(generate, reply.record)
                async with contextlib.aclosing(events):
                    if parsed.stream:
                        response, outcome = await stream_reply(
                            request, reply, events, parsed.include_usage, self.metrics, lambda: self.cutting
                        )
                    else:
                        response, outcome = await self._complete(reply, events)
            return response
        except (Overloaded, RequestFailed) as e:
            error = api_error(e)
            outcome = "overloaded" if error.status == 503 else "error"
            raise error from e
        except asyncio.CancelledError:
            if not self.cutting:
                outcome = "abort"
                raise
            task.uncancel()  # cut at shutdown, before a stream's first token: a 503 still gets out
            raise CUT from None
        finally:
            self.running.discard(task)
            reply.seal(time.perf_counter())
            self.metrics.request_finished(reply.record, outcome)

    async def _complete(self, reply: CompletionReply, events: AsyncIterator[TokenEvent]) -> tuple[web.Response, str]:
        async for event in events:
            reply.add(event, time.perf_counter())
        check_finished(reply)
        reply.seal(time.perf_counter())
        return web.json_response(reply.body()), str(reply.finish_reason)


class ConnectionLimit:
    """aiohttp's protocol factory, with each connection counted while it lives. While ``limit`` are open a new one
    gets the ``Refusals`` 503 at once, rather than a place in the kernel's queue; reaching the limit is logged
    through ``log`` (a ``RateLimitedLog``: once a period, with a count)."""

    def __init__(
        self, factory: Callable[[], asyncio.Protocol], limit: int, metrics: ServeMetrics, log: Callable[..., bool]
    ) -> None:
        self._factory, self.limit, self._metrics, self._log = factory, limit, metrics, log
        self.open = 0
        self._refuse = Refusals(limit)

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.limit:
            self._metrics.request_error(TOO_MANY)
            self._log("full", logging.WARNING, f"{self.open} HTTP connections open, the limit: new ones get 503")
            return self._refuse()
        return _Counted(self._factory(), self)

    def count(self, change: int) -> None:
        self.open += change
        self._metrics.connections.set(self.open)


class _Counted(asyncio.Protocol):
    """The real protocol, counted from its making (the transport calls connection_made next) to its loss."""

    def __init__(self, inner: asyncio.Protocol, limit: ConnectionLimit) -> None:
        self._inner, self._limit = inner, limit
        limit.count(+1)

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
        self._limit.count(-1)
        self._inner.connection_lost(exc)
