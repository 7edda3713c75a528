"""The gateway's end of the pre-loaded parent (``zygote``): forked workers that look like child processes.

    forks = ForkServer("shakespeare-qwen3.5")
    await forks.start()                          # the parent starts importing at once
    process = await forks.spawn(flags, env)      # a worker: pid, stdin, stdout, returncode, wait(), kill()
    await forks.close()                          # the parent exits; its workers go on until their stdin closes

A ``ForkedProcess`` has what ``LocalLauncher`` uses of an asyncio child process,
so the launcher treats both alike. Its exit status comes from the parent, which
reaps it; if the parent itself dies, each worker's end is found by polling its
pid. Anything that goes wrong with the parent raises ``ForkError``, and the
launcher starts the worker as a fresh interpreter instead.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import sys

from minifaas.child_process import wait_or_kill
from minifaas.parent_watch import PARENT_ENV, child_env

log = logging.getLogger("minifaas.gateway")
READY_TIMEOUT_S = 120.0  # the parent's imports: seconds on a quiet machine, more on a busy one


class ForkError(RuntimeError):
    """The pre-loaded parent cannot fork a worker now."""


class _Stdin:
    """The write end of a worker's stdin: closing it is how the gateway says stop."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ForkedProcess:
    def __init__(self, pid: int, stdin: int, stdout: asyncio.StreamReader, transport: asyncio.BaseTransport) -> None:
        self.pid = pid
        self.stdin = _Stdin(stdin)
        self.stdout = stdout
        self.returncode: int | None = None
        self._transport = transport
        self._ended = asyncio.Event()

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._transport.close()
            self._ended.set()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def poll_until_gone(self, period: float = 0.2) -> None:
        """The parent is gone, so nobody reports this worker's end: watch its pid instead."""
        while self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.ended(1)  # its status went to whoever reaped it
                return
            await asyncio.sleep(period)


class ForkServer:
    def __init__(self, model: str) -> None:
        self.model = model
        self.parent: asyncio.subprocess.Process | None = None
        self.processes: dict[int, ForkedProcess] = {}
        self._control: socket.socket | None = None
        self._ready: asyncio.Future[int] | None = None
        self._replies: dict[int, asyncio.Future[dict]] = {}
        self._ids = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self._watchers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message per request
        try:
            argv = [sys.executable, "-m", "minifaas.serve.launch.zygote", str(theirs.fileno()), self.model]
            self.parent = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, pass_fds=(theirs.fileno(),), env=child_env()
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._control = ours
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read_events())

    async def spawn(self, flags: list[str], env: dict[str, str], timeout: float = 30.0) -> ForkedProcess:
        """Fork a worker with these ``minifaas worker`` flags and this environment."""
        if self._ready is None or self._control is None or self.parent is None:
            raise ForkError("the pre-loaded parent is not running")
        env = {**env, PARENT_ENV: str(self.parent.pid)}  # its parent is the zygote, which dies with the gateway
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await asyncio.shield(self._ready)
        except TimeoutError:
            raise ForkError(f"the pre-loaded parent was not ready after {READY_TIMEOUT_S:.0f} s") from None
        loop = asyncio.get_running_loop()
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        request_id = next(self._ids)
        reply = self._replies[request_id] = loop.create_future()
        try:
            message = json.dumps({"id": request_id, "argv": flags, "env": env}).encode()
            fds = array.array("i", [stdin_r, stdout_w])
            self._control.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            async with asyncio.timeout(timeout):
                answer = await reply
        except (OSError, TimeoutError) as e:
            os.close(stdin_w)
            os.close(stdout_r)
            raise ForkError(f"the pre-loaded parent did not fork: {e!r}") from None
        finally:
            self._replies.pop(request_id, None)
            os.close(stdin_r)
            os.close(stdout_w)
        if "pid" not in answer:
            os.close(stdin_w)
            os.close(stdout_r)
            raise ForkError(f"the pre-loaded parent did not fork: {answer.get('error')}")
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(stdout_r, "rb", 0)
        )
        process = self.processes[answer["pid"]] = ForkedProcess(answer["pid"], stdin_w, reader, transport)
        return process

    async def _read_events(self) -> None:
        assert self.parent is not None and self.parent.stdout is not None and self._ready is not None
        try:
            while line := await self.parent.stdout.readline():
                event = json.loads(line)
                if "ready" in event:
                    self._ready.set_result(event["ready"])
                elif "exit" in event:
                    process = self.processes.pop(event["exit"], None)
                    if process is not None:
                        process.ended(event["code"])
                elif (reply := self._replies.get(event.get("id"))) is not None and not reply.done():
                    reply.set_result(event)
        finally:  # the parent is gone: nothing more will be forked or reported
            failure = ForkError("the pre-loaded parent exited")
            if not self._ready.done():
                self._ready.set_exception(failure)
            for reply in self._replies.values():
                if not reply.done():
                    reply.set_exception(failure)
            for process in self.processes.values():
                watcher = asyncio.get_running_loop().create_task(process.poll_until_gone())
                self._watchers.add(watcher)
                watcher.add_done_callback(self._watchers.discard)
            self.processes.clear()

    async def close(self) -> None:
        """Stop the parent (its workers are the launcher's to stop)."""
        if self._control is not None:
            self._control.close()  # the parent exits at the end of its control socket
            self._control = None
        if self.parent is not None:
            if self.parent.returncode is None:
                await wait_or_kill(self.parent, grace=5)
            self.parent = None
        if self._reader is not None:
            await self._reader
            self._reader = None
        if self._ready is not None and self._ready.done() and not self._ready.cancelled():
            self._ready.exception()  # retrieved: a parent that never became ready is not an unhandled error
