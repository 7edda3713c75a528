"""The gateway's handle on one worker process: start it, talk to it, notice when it dies.

Replies from the worker are sorted into one inbox per request; a reply no
request waits for any more (the notice of a prefill stopped by an abort) goes
to ``on_unclaimed``. When the control connection ends (the process died or was killed), every open inbox
receives ``{"op": "lost"}``, so no request waits on a worker that is gone.

A worker that is changing role (``serve.roles``) is ``draining``: the router
sends it nothing new, and ``wait_idle`` returns once the requests it holds
(open inboxes, and prefills routed to it that have not opened one yet:
``claims``) are done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable

from minifaas.child_process import describe_exit, wait_or_kill
from minifaas.serve import control
from minifaas.serve.control import CACHE_EVENTS

log = logging.getLogger("minifaas.gateway")
LOST = {"op": "lost"}


class WorkerError(RuntimeError):
    pass


class WorkerHandle:
    def __init__(self, name: str, role: str, cluster: str, argv: list[str], secret: bytes) -> None:
        self.name, self.role, self.cluster = name, role, cluster
        self.argv, self.secret = argv, secret
        self.process: asyncio.subprocess.Process | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.kv_port = 0
        self.codecs: dict[str, list[float]] = {}  # what a prefill worker measured of its codecs when it started
        self.alive = False
        self.restarts = 0
        self.load_tokens = 0  # prompt tokens sent and not yet answered (prefill) / requests decoding
        self.inboxes: dict[str, asyncio.Queue[dict]] = {}
        self.draining = False  # changing role: routed nothing new
        self.retired = False  # stopped for good (replaced by a worker in its new role)
        self.claims = 0  # prefills routed here that have not opened their inbox yet
        self._quieter = asyncio.Event()  # set whenever a request lets go of the worker
        self.on_unclaimed: Callable[[WorkerHandle, dict], None] | None = None

    @property
    def serving(self) -> bool:
        """Takes new requests: running and not draining."""
        return self.alive and not self.draining

    @property
    def requests(self) -> int:
        """Requests waiting on replies from the worker (not the cache-events inbox, open for the worker's life)."""
        return sum(req != CACHE_EVENTS for req in self.inboxes)

    @property
    def busy(self) -> int:
        """Requests that still hold the worker."""
        return self.claims + self.requests

    def release(self) -> None:
        """A claim is over (the prefill opened its inbox, or went elsewhere)."""
        self.claims -= 1
        self._quieter.set()

    async def wait_idle(self) -> None:
        while self.busy:
            self._quieter.clear()
            await self._quieter.wait()

    async def start(self, timeout: float = 300.0) -> asyncio.StreamReader:
        argv = [sys.executable, "-m", "minifaas.serve.worker", "--role", self.role, "--name", self.name, *self.argv]
        env = {**os.environ, "MINIFAAS_KV_SECRET": self.secret.hex()}
        self.process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env
        )
        try:
            async with asyncio.timeout(timeout):
                line = await self.process.stdout.readline()  # type: ignore[union-attr]
                ready = json.loads(line)
                reader, self.writer = await asyncio.open_connection(
                    "127.0.0.1", ready["control_port"], limit=control.MAX_LINE
                )
        except (TimeoutError, json.JSONDecodeError, OSError) as e:
            await self.stop()
            raise WorkerError(f"worker {self.name} did not start: {e!r}") from None
        self.kv_port = ready["kv_port"]
        self.codecs = ready.get("codecs", {})
        self.alive = True
        log.debug("worker %s (%s, %s) ready, pid %s", self.name, self.role, self.cluster, ready["pid"])
        return reader

    async def pump(self, reader: asyncio.StreamReader) -> None:
        """Deliver replies until the worker goes away; then wake every waiting request."""
        try:
            async for msg in control.messages(reader):
                inbox = self.inboxes.get(msg.get("req", ""))
                if inbox is not None:
                    inbox.put_nowait(msg)
                elif self.on_unclaimed is not None:
                    self.on_unclaimed(self, msg)
        except (ConnectionError, json.JSONDecodeError) as e:
            log.warning("worker %s: control channel broke: %r", self.name, e)
        finally:
            self.alive = False
            for inbox in self.inboxes.values():
                inbox.put_nowait(LOST)

    def open(self, req: str) -> asyncio.Queue[dict]:
        self.inboxes[req] = asyncio.Queue()
        return self.inboxes[req]

    def close(self, req: str) -> None:
        self.inboxes.pop(req, None)
        self._quieter.set()

    def send(self, message: dict) -> None:
        if not self.alive or self.writer is None:
            raise WorkerError(f"worker {self.name} is not running")
        control.send(self.writer, message)

    async def stop(self) -> None:
        self.alive = False
        if self.writer is not None:
            self.writer.close()
        p = self.process
        if p is None or p.returncode is not None:
            return
        if p.stdin is not None:
            p.stdin.close()  # the worker exits when its stdin closes
        await wait_or_kill(p, grace=5)

    async def exit_status(self, grace: float = 5.0) -> str:
        """How the process ended, once it has: "exit code 1", "killed by SIGKILL". One still running
        ``grace`` seconds after its control channel closed is killed."""
        p = self.process
        if p is None:
            return "never started"
        if await wait_or_kill(p, grace):
            return f"control channel closed, still running after {grace:g} s: killed"
        return describe_exit(p.returncode)

    def kill(self) -> None:
        """Kill the process now (fault injection in tests and the demo)."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
