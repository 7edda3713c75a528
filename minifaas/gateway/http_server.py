"""The HTTP server: the OpenAI app's routes, served within bounds so no client can hold it: connections, headers,
bodies, logs.

    async with serve_http(build_app(gateway, metrics, key, http), host, port, http, metrics) as site: ...

Connections over the cap are answered 503 at once, slow headers and bodies are cut off, and the event loop's
error log is rate limited so a flood of one failure stays a line with a count. At shutdown (``finish``) the
requests in flight have the grace to finish; then the rest are cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import resource
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from minifaas.config import HttpConfig
from minifaas.gateway.api import ConnectionLimit, GatewayAPI, OpenAIServer, bearer_auth, openai_errors
from minifaas.gateway.api_errors import LINGER_S
from minifaas.gateway.metrics import ServeMetrics

log = logging.getLogger("minifaas.http")
FD_SHARE = 0.75  # of the descriptor limit, the most the HTTP clients may hold


def build_app(
    gateway: GatewayAPI, metrics: ServeMetrics, api_key: str | None, http: HttpConfig | None = None
) -> web.Application:
    """The OpenAI API's routes, /health and /metrics; every error an OpenAI error body, /v1 behind ``api_key``."""
    http = http or HttpConfig()
    api = OpenAIServer(gateway, metrics, http)
    middlewares = [openai_errors(metrics), bearer_auth(api_key)]
    app = web.Application(client_max_size=http.max_body_bytes, middlewares=middlewares)
    app.on_shutdown.append(functools.partial(finish, api))
    app.on_cleanup.append(api.close)

    async def models(request: web.Request) -> web.Response:
        model = {
            "id": gateway.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "minifaas",
            "max_model_len": gateway.max_context,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def health(request: web.Request) -> web.Response:
        """200 with the gateway's report when it says ``"healthy": true``, else 503 with the same report."""
        report = gateway.health()
        return web.json_response(report, status=200 if report.get("healthy") is True else 503)

    async def metrics_text(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": metrics.content_type})

    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_text)
    return app


CUT_S = 2.0  # how long requests cut at shutdown have to send their 503 or error event


async def finish(api: OpenAIServer, app: web.Application) -> None:
    """At shutdown: the requests in flight get the grace to finish, then the rest are cut (a second signal,
    which cancels this wait, cuts them at once)."""
    try:
        if api.running:
            await asyncio.wait(set(api.running), timeout=api.http.shutdown_grace)
    finally:
        api.cutting = True
        for task in api.running:
            task.cancel()
        if api.running:
            await asyncio.wait(set(api.running), timeout=CUT_S)


class RateLimitedLog:
    """One line per ``period`` seconds for a message that keeps coming, with how often it came meanwhile."""

    def __init__(self, logger: logging.Logger, period: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._logger, self.period, self._clock = logger, period, clock
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (when last logged, times since)

    def __call__(self, key: str, level: int, message: str, exc_info: BaseException | None = None) -> bool:
        """Log ``message`` unless ``key`` was logged less than ``period`` ago; True if it was logged."""
        now = self._clock()
        last, since = self._seen.get(key, (-self.period, 0))
        if now - last < self.period:
            self._seen[key] = (last, since + 1)
            return False
        if since:
            message += f" ({since} more times since it was last logged)"
        self._seen[key] = (now, 0)
        self._logger.log(level, "%s", message, exc_info=exc_info)
        return True


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (or the kernel's ceiling); returns the soft limit now."""
    unlimited = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != unlimited else max(soft, 1 << 20)
    if soft != unlimited and soft < target:
        with contextlib.suppress(ValueError, OSError):  # a hard limit past the kernel's nr_open
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return sys.maxsize if soft == unlimited else soft


def connection_cap(configured: int, fd_limit: int) -> int:
    """``configured``, lowered to fit the descriptor limit."""
    cap = min(configured, int(fd_limit * FD_SHARE))
    if cap < 1:
        raise ValueError(f"a descriptor limit of {fd_limit} leaves no room for HTTP connections")
    if cap < configured:
        log.warning("max_connections lowered from %d to %d: this process may open %d files", configured, cap, fd_limit)
    return cap


class BoundedSite(web.BaseSite):
    """A TCP site whose protocol factory is wrapped in a ConnectionLimit."""

    __slots__ = ("_bound_port", "_host", "_port", "limit")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limit: int, metrics: ServeMetrics, backlog: int):
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._bound_port = host, port, port
        assert runner.server is not None
        self.limit = ConnectionLimit(runner.server, limit, metrics, RateLimitedLog(log))

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._bound_port}"

    @property
    def port(self) -> int:
        return self._bound_port

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self.limit, self._host, self._port, backlog=self._backlog)
        self._bound_port = self._server.sockets[0].getsockname()[1]


def limit_loop_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log the loop's unhandled errors through a RateLimitedLog, keyed by message and error."""
    limited = RateLimitedLog(log)

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = context.get("message", "unhandled error in the event loop")
        error = context.get("exception")
        key = f"{message}|{type(error).__name__}|{getattr(error, 'errno', '')}"
        limited(key, logging.ERROR, f"{message}: {error!r}" if error else message, error)

    loop.set_exception_handler(handler)


@contextlib.asynccontextmanager
async def serve_http(
    app: web.Application, host: str, port: int, http: HttpConfig, metrics: ServeMetrics
) -> AsyncIterator[BoundedSite]:
    """``app`` listening on host:port within the bounds of ``http``; yields the site (its ``name``, its ``limit``)."""
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    limit_loop_errors(loop)
    runner = web.AppRunner(
        app,
        handle_signals=False,
        handler_cancellation=True,
        keepalive_timeout=http.header_timeout,
        lingering_time=LINGER_S,
        shutdown_timeout=CUT_S,  # after ``finish``: for other routes' handlers to end
    )
    await runner.setup()
    try:
        cap = connection_cap(http.max_connections, raise_fd_limit())
        site = BoundedSite(runner, host, port, cap, metrics, http.backlog)
        await site.start()
        yield site
    finally:
        await runner.cleanup()
        loop.set_exception_handler(previous)
