"""The HTTP server's bounds, from real sockets: a full server answers 503 at once, slow clients are cut off.

The server is the one ``minifaas serve`` runs (``serve_http``) around the app and the
in-memory gateway of test_api; the connections are raw loopback sockets, idle or sending
a byte at a time, as a hostile client would hold them. An accept loop that runs out of
file descriptors is run in a child process with a low descriptor limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from test_api import GOOD, KEY, C, FakeGateway, metric_samples, run_async, series

from minifaas.config import HttpConfig
from minifaas.gateway.api_errors import LINGER_S
from minifaas.gateway.http_server import BoundedSite, build_app, connection_cap, serve_http
from minifaas.gateway.metrics import ServeMetrics

LIMITS = HttpConfig(max_connections=32, header_timeout=1.0, body_timeout=1.0)
FULL = HttpConfig(max_connections=32, header_timeout=3.0)  # the idle ones stay while the 503s are checked
AUTH = f"Authorization: Bearer {KEY}\r\n"


@asynccontextmanager
async def bounded(http: HttpConfig = LIMITS) -> AsyncIterator[tuple[BoundedSite, ServeMetrics]]:
    metrics = ServeMetrics()
    async with serve_http(build_app(FakeGateway(), metrics, KEY, http), "127.0.0.1", 0, http, metrics) as site:
        yield site, metrics


async def connect(site: BoundedSite) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", site.port)


async def post(site: BoundedSite) -> tuple[int, dict[str, str], dict]:
    """A well-behaved client on a fresh connection: status, headers, body."""
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as client,
        client.post(f"http://127.0.0.1:{site.port}{C}", json=GOOD) as resp,
    ):
        return resp.status, dict(resp.headers), json.loads(await resp.read())


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    """Seconds until the server closes the connection (after whatever it sent)."""
    start = time.monotonic()
    async with asyncio.timeout(seconds):
        while await reader.read(4096):
            pass
    return time.monotonic() - start


@run_async
async def test_a_full_server_answers_503_at_once_and_serves_again_once_idle_clients_are_cut(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="minifaas.http")
    async with bounded(FULL) as (site, metrics):
        held = [await connect(site) for _ in range(FULL.max_connections)]  # idle: not a byte sent
        while site.limit.open < FULL.max_connections:
            await asyncio.sleep(0.01)
        start = time.monotonic()
        status, headers, body = await post(site)
        assert time.monotonic() - start < FULL.header_timeout  # refused at once, not queued behind the idle ones
        assert status == 503 and headers["Retry-After"] == "1" and body["error"]["code"] == "too_many_connections"
        more = [await connect(site) for _ in range(200)]  # a flood of new connections: each gets its 503
        answers = await asyncio.gather(*(r.read() for r, _ in more))
        assert all(a.startswith(b"HTTP/1.1 503 ") for a in answers)
        assert caplog.text.count("HTTP connections open, the limit") == 1  # once, not 201 times

        for reader, _ in held:  # never sent a request head: cut at the header timeout
            assert await closed_within(reader, FULL.header_timeout + 2.0) <= FULL.header_timeout + 2.0
        status, _, body = await post(site)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        samples = metric_samples(metrics.exposition().decode())
        assert samples[series("minifaas:request_errors_total", cause="too_many_connections")] == 201
        assert samples[series("minifaas:http_connections")] == 0
        for _, writer in held + more:
            writer.close()


@run_async
async def test_slow_headers_and_slow_bodies_are_cut_off_in_bounded_time() -> None:
    async with bounded() as (site, _):
        slow_head = await connect(site)
        slow_head[1].write(f"POST {C} HTTP/1.1\r\nHost: x\r\n{AUTH}".encode())
        slow_body = await connect(site)
        body = json.dumps(GOOD).encode()
        slow_body[1].write(
            f"POST {C} HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:5]
        )

        async def trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
            for byte in data:  # one byte every 0.1 s: each well inside any per-read timeout
                if writer.is_closing():
                    return
                writer.write(bytes([byte]))
                await asyncio.sleep(0.1)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(trickle(slow_head[1], b"X-Slow: " + b"a" * 100))
            tg.create_task(trickle(slow_body[1], body[5:] * 4))
            assert await closed_within(slow_head[0], 4.0) < LIMITS.header_timeout + 1.0
            start = time.monotonic()
            answer = await slow_body[0].read()
            assert time.monotonic() - start < LIMITS.body_timeout + LINGER_S + 1.0  # answered, then cut
            slow_head[1].close()
            slow_body[1].close()
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and json.loads(payload)["error"]["code"] == "body_timeout"
        assert (await post(site))[0] == 200


def test_the_cap_stays_under_the_descriptor_limit() -> None:
    assert connection_cap(1024, 20000) == 1024
    assert connection_cap(1024, 1000) == 750
    with pytest.raises(ValueError, match="no room"):
        connection_cap(1024, 1)


ACCEPT_FLOOD = """
import asyncio, logging, os, resource, socket, sys
sys.path.insert(0, {tests!r})
from test_api import FakeGateway
from minifaas.gateway.http_server import build_app
from minifaas.config import HttpConfig
from minifaas.gateway.api_errors import LINGER_S
from minifaas.gateway.http_server import serve_http
from minifaas.gateway.metrics import ServeMetrics

logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

async def main():
    http, metrics = HttpConfig(max_connections=1000), ServeMetrics()
    async with serve_http(build_app(FakeGateway(), metrics, None, http), "127.0.0.1", 0, http, metrics) as site:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        hogs = []
        while True:  # every descriptor taken, as by some other part of the process
            try:
                hogs.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        for fd in hogs[-40:]:
            os.close(fd)
        clients = []
        for _ in range(40):  # each takes a descriptor here; none is left for the server's accept()
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", site.port))
            except BlockingIOError:
                pass
            clients.append(s)
        await asyncio.sleep(2.0)  # asyncio retries the accept every second, and once logged each attempt
        print("accepts ran out of descriptors for 2 s", flush=True)

asyncio.run(main())
"""


def test_an_accept_loop_out_of_descriptors_logs_once_not_per_attempt(tmp_path: Path) -> None:
    script = tmp_path / "flood.py"
    script.write_text(textwrap.dedent(ACCEPT_FLOOD.format(tests=str(Path(__file__).parent))))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert "accepts ran out of descriptors for 2 s" in done.stdout, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "out of system resource" in line]
    assert 1 <= len(lines) <= 2, done.stderr[-2000:]  # asyncio retries every second; logged once per 10 s
