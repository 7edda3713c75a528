"""The gateway's end of the pre-loaded parent (``zygote``): forked workers that look like child processes.

    forks = acquire("shakespeare-qwen3.5")       # this process's parent for the model, started if need be
    process = await forks.spawn(flags, env)      # a worker: pid, stdin, stdout, returncode, wait(), kill()
    release(forks)                               # its workers are the caller's to stop; the parent stays

A ``ForkedProcess`` has what ``LocalLauncher`` uses of an asyncio child process; any failure of the parent raises
``ForkError``. One parent per model and environment (an import may read a variable) serves every gateway of
the process, shared only from the main thread, since PR_SET_PDEATHSIG ends it with the thread that started it.
"""

from __future__ import annotations

import array
import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from minifaas.launch import zygote
from minifaas.parent_watch import GATEWAY_ENV, PARENT_ENV, child_env, running

log = logging.getLogger("minifaas.gateway")
READY_TIMEOUT_S = 120.0  # the parent's imports, on a busy machine too
FORK_TIMEOUT_S = 5.0  # a fork's answer is quick: a parent this slow is stopped or stuck, and is killed
VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})  # changed per test by a test runner; no import reads it


class ForkError(RuntimeError):
    """The pre-loaded parent cannot fork a worker now."""


class ForkedProcess:
    def __init__(self, pid: int, stdin: int, stdout: asyncio.StreamReader, transport: asyncio.BaseTransport) -> None:
        self.pid = pid
        self.stdin = os.fdopen(stdin, "wb", 0)  # closing it is how the gateway says stop
        self.stdout = stdout
        self.returncode: int | None = None
        self.reaped_here = True  # False: its parent was lost, and its status with it
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

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    async def poll_until_gone(self, period: float = 0.2) -> None:
        """The parent is gone, so nobody reports this worker's end: watch its pid instead."""
        while self.returncode is None:
            if not running(self.pid):
                self.reaped_here = False
                self.ended(1)  # its status went to whoever reaps it
                return
            await asyncio.sleep(period)


class ForkServer:
    """One pre-loaded parent process and the workers it forked (``acquire`` one rather than build it)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.parent: subprocess.Popen[bytes] | None = None
        self.users = 0  # launchers holding it (``acquire`` / ``release``)
        self._processes: dict[int, tuple[asyncio.AbstractEventLoop, ForkedProcess]] = {}
        self._exited: dict[int, int] = {}  # ends reported before their fork's reply was handled
        self._replies: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[dict]]] = {}
        self._control: socket.socket | None = None
        self._ready: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._ended = threading.Event()  # the parent's stdout has closed: it is gone
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._watchers: set[asyncio.Task[None]] = set()

    def start(self, here: bool = False) -> None:
        """Start the parent; it imports at once, in its own process, while the caller goes on. ``here``:
        import in this process and fork it (``start_here``), so it is ready when this returns."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one message per request
        try:
            if here:
                self.parent = _fork_parent(self.model, theirs, ours)
            else:
                argv = [sys.executable, "-m", "minifaas.launch.zygote", str(theirs.fileno()), self.model]
                self.parent = subprocess.Popen(
                    argv, stdout=subprocess.PIPE, pass_fds=(theirs.fileno(),), env=child_env()
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._control = ours
        threading.Thread(target=self._read_events, name=f"forks-{self.parent.pid}", daemon=True).start()

    @property
    def running(self) -> bool:
        return self.parent is not None and self._control is not None and not self._ended.is_set()

    async def spawn(self, flags: list[str], env: dict[str, str], timeout: float = FORK_TIMEOUT_S) -> ForkedProcess:
        """Fork a worker with these ``minifaas worker`` flags and this environment. A parent that does not
        answer within ``timeout`` is killed (its workers live on), so the next caller starts a fresh one."""
        if not self.running:
            raise ForkError("the pre-loaded parent is not running")
        assert self.parent is not None and self._control is not None
        # its parent is the zygote; it dies with the gateway (this process), and outlives the zygote
        env = {**env, PARENT_ENV: str(self.parent.pid), GATEWAY_ENV: str(os.getpid())}
        try:  # shielded: a caller that gives up must not cancel the readiness every caller shares
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._ready)), READY_TIMEOUT_S)
        except TimeoutError:
            raise ForkError(f"the pre-loaded parent was not ready after {READY_TIMEOUT_S:.0f} s") from None
        loop = asyncio.get_running_loop()
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        request_id = next(self._ids)
        reply: asyncio.Future[dict] = loop.create_future()
        with self._lock:
            self._replies[request_id] = (loop, reply)
        try:
            message = json.dumps({"id": request_id, "argv": flags, "env": env}).encode()
            fds = array.array("i", [stdin_r, stdout_w])
            self._control.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            async with asyncio.timeout(timeout):
                answer = await reply
        except (OSError, TimeoutError, ForkError) as e:  # ForkError: the parent exited before it answered
            if isinstance(e, TimeoutError):
                self.parent.kill()
            answer = {"error": repr(e)}
        finally:
            with self._lock:
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
        process = ForkedProcess(answer["pid"], stdin_w, reader, transport)
        with self._lock:
            code = self._exited.pop(process.pid, None)
            if code is None:
                self._processes[process.pid] = (loop, process)
        if code is not None:  # it was already over
            process.ended(code)
        return process

    def _read_events(self) -> None:
        """The parent's event lines, on this thread; each goes to the loop of the worker it concerns."""
        assert self.parent is not None and self.parent.stdout is not None
        try:
            for line in self.parent.stdout:
                event = json.loads(line)
                if "ready" in event:
                    self._ready.set_result(event["ready"])
                elif "exit" in event:
                    with self._lock:
                        entry = self._processes.pop(event["exit"], None)
                        if entry is None:
                            self._exited[event["exit"]] = event["code"]
                    if entry is not None:
                        _call_in(entry[0], entry[1].ended, event["code"])
                else:
                    with self._lock:
                        waiting = self._replies.get(event.get("id"))
                    if waiting is not None:
                        _call_in(waiting[0], _settle, waiting[1], event, None)
        except (ValueError, OSError) as e:
            log.warning("the pre-loaded parent's events stopped: %r", e)
        finally:  # the parent is gone: nothing more will be forked or reported
            self._ended.set()
            failure = ForkError("the pre-loaded parent exited")
            if not self._ready.done():
                self._ready.set_exception(failure)
            with self._lock:
                replies, processes = list(self._replies.values()), list(self._processes.values())
                self._processes.clear()
            for loop, reply in replies:
                _call_in(loop, _settle, reply, {}, failure)
            for loop, process in processes:
                _call_in(loop, self._watch, process)
            self.parent.stdout.close()

    def _watch(self, process: ForkedProcess) -> None:
        watcher = asyncio.get_running_loop().create_task(process.poll_until_gone())
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    def close(self, grace: float = 5.0) -> None:
        """Stop the parent: it exits at the end of its control socket (its workers are their launcher's)."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if self.parent is not None:
            try:
                self.parent.wait(timeout=grace)  # it exits at once: os._exit, nothing torn down
            except subprocess.TimeoutExpired:
                self.parent.kill()
                self.parent.wait()


class _Forked:
    """A parent forked from this process, with what ``ForkServer`` uses of a ``subprocess.Popen``."""

    def __init__(self, pid: int, stdout: IO[bytes]) -> None:
        self.pid, self.stdout = pid, stdout
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = zygote.returncode(status)
            elif deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pre-loaded parent {self.pid}", timeout or 0.0)
            else:
                time.sleep(0.01)
        return self.returncode

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0)
        return None

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _fork_parent(model: str, theirs: socket.socket, ours: socket.socket) -> _Forked:
    """Import what a worker of ``model`` needs here, then fork the parent from this process."""
    zygote.preload(model)
    events_r, events_w = os.pipe()
    sys.stdout.flush()  # nothing buffered may be written twice
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the parent-to-be: nothing of this process's but the imports, and never back to its code
        try:
            ours.close()
            os.close(events_r)
            os.dup2(events_w, 1)
            os.close(events_w)
            os.environ[PARENT_ENV] = str(os.getppid())
            zygote.tie_to_gateway()
            zygote.run(theirs)
        finally:
            os._exit(1)
    os.close(events_w)
    return _Forked(pid, os.fdopen(events_r, "rb"))


def _call_in(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    with contextlib.suppress(RuntimeError):  # that loop has closed: nobody is waiting there any more
        loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future[dict], result: dict, error: BaseException | None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


_shared: dict[tuple[str, frozenset[tuple[str, str]]], ForkServer] = {}
_shared_lock = threading.Lock()


def acquire(model: str) -> ForkServer:
    """The pre-loaded parent for ``model`` that this process's launchers share, started if need be; from a
    thread other than the main one, a parent of the caller's own, closed at ``release``."""
    if threading.current_thread() is not threading.main_thread():
        forks = ForkServer(model)
        forks.start()
        forks.users = 1
        return forks
    key = _key(model)
    with _shared_lock:
        forks = _shared.get(key)
        if forks is None or not forks.running:
            for other_key, other in list(_shared.items()):  # idle ones for an old environment are not kept
                if other.users == 0 or not other.running:
                    other.close()
                    del _shared[other_key]
            forks = _shared[key] = ForkServer(model)
            forks.start()
        forks.users += 1
        return forks


def start_here(model: str) -> bool:
    """Make this process's shared parent for ``model`` by forking this very process, which keeps its imports;
    True if it did. Only on the main thread with no other thread and no event loop running, since a fork copies
    only its caller's thread, with every lock as it stands; elsewhere ``acquire`` starts a fresh parent."""
    if threading.current_thread() is not threading.main_thread() or threading.active_count() > 1:
        return False
    with contextlib.suppress(RuntimeError):
        asyncio.get_running_loop()
        return False
    with _shared_lock:
        if any(forks.model == model and forks.running for forks in _shared.values()):
            return False
    forks = ForkServer(model)
    try:
        forks.start(here=True)  # outside the lock: the parent must not start with a lock taken
    except OSError as e:  # no fork now (memory, process limits): the launcher starts a fresh parent instead
        log.warning("could not fork the pre-loaded parent from this process: %s", e)
        return False
    with _shared_lock:
        _shared[_key(model)] = forks  # after the imports, which may set variables (TORCHINDUCTOR_CACHE_DIR)
    return True


def _key(model: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return model, frozenset((k, v) for k, v in os.environ.items() if k not in VOLATILE_ENV)


def release(forks: ForkServer) -> None:
    """A launcher is done with ``forks``: a shared parent stays for the next one, any other is closed."""
    with _shared_lock:
        forks.users -= 1
        shared = forks in _shared.values()
        if shared and not forks.running:
            for key in [k for k, v in _shared.items() if v is forks]:
                del _shared[key]
            shared = False
    if not shared and forks.users <= 0:
        forks.close()


@atexit.register
def close_shared() -> None:
    """Stop every shared parent: at exit, or before a start that must be cold."""
    with _shared_lock:
        for forks in _shared.values():
            forks.close()
        _shared.clear()
