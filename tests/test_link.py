"""The gateway's inter-cluster link on its own: real emulator processes, real sockets, decode workers joining.

Workers start in parallel, so several decode workers join the link at once: there must be one emulator
with a route to each of them, every route must reach its own worker, and the link must close promptly,
even while its supervisor is bringing a killed emulator back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import pytest

from minifaas.cache.prefix_index import PrefixDirectory
from minifaas.config import InterClusterLinkConfig
from minifaas.control.heartbeat import HeartbeatConfig
from minifaas.gateway.inter_cluster_link import NAME, InterClusterLink
from minifaas.gateway.worker_handle import WorkerHandle
from minifaas.launch.launcher import WorkerSpec

pytestmark = pytest.mark.timeout(120)


def _decode_worker(name: str, listener: socket.socket) -> WorkerHandle:
    w = WorkerHandle(
        WorkerSpec(name, "decode", "pd"), name, "decode", "pd", PrefixDirectory(False, 16, "test", False, ())
    )
    w.kv = listener.getsockname()
    return w


def _listener() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def _reaches(port: int, listener: socket.socket) -> bool:
    """Bytes sent to ``port`` arrive at ``listener``, through the emulator."""
    loop = asyncio.get_running_loop()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"hello")
    await writer.drain()
    async with asyncio.timeout(10):
        conn, _ = await loop.sock_accept(listener)
        got = await loop.sock_recv(conn, 5)
    conn.close()
    writer.close()
    return got == b"hello"


def _link() -> InterClusterLink:
    return InterClusterLink(InterClusterLinkConfig(rate="100mbit"), True, False, HeartbeatConfig(0.2, 1.0))


def test_decode_workers_joining_at_once_share_one_emulator_and_each_has_its_route() -> None:
    async def scenario() -> None:
        listeners = [_listener() for _ in range(3)]
        workers = [_decode_worker(f"pd-d{i}", s) for i, s in enumerate(listeners)]
        link = _link()
        async with link:
            await asyncio.gather(*(link.join(w) for w in workers))
            assert len(link.emulators()) == 1
            assert set(link.routes) == {w.name for w in workers}
            for w, listener in zip(workers, listeners, strict=True):
                _, port = link.kv_routes[w.name]
                assert await _reaches(port, listener), w.name
            emulator = link.emulator
        assert emulator is not None and not emulator.alive
        for s in listeners:
            s.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_link_closes_while_its_supervisor_restarts_a_killed_emulator() -> None:
    async def scenario() -> None:
        listener = _listener()
        link = _link()
        async with link:
            await link.join(_decode_worker("pd-d0", listener))
            emulator = link.emulator
            assert emulator is not None
            os.kill(emulator.pid, signal.SIGKILL)
            async with asyncio.timeout(10):
                while NAME not in link.down:
                    await asyncio.sleep(0.05)
        assert not emulator.alive  # the restart in progress was called off with the link
        listener.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
