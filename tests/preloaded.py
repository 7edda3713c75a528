"""Commands run as processes forked from one interpreter that has already imported torch and minifaas.

The suite runs about ninety documented commands, benchmarks and examples
(``python -m minifaas.commands.main ...``, ``python benchmarks/x.py ...``), and a fresh
interpreter pays 3-4 s of CPU importing torch, transformers and the serving
code before its first line of work. Here that is paid once: a server process
imports it all, then forks one child per command. A child is a whole process
of its own (pid, stdin, stdout, stderr, working directory, environment,
session), and from its first line it runs the command exactly as
``python ARGV`` would, through ``runpy``; it ends as an interpreter ends
(non-daemon threads joined, exit handlers run, streams flushed, the exit status
the command gave), except that its modules are not torn down: a second of CPU
per command with torch loaded, and nothing to see. Only the imports are shared.
(The project's own pre-loaded parent, ``minifaas.launch.zygote``, does
the same for workers; this one runs any command line.)

    with Preloaded() as python:
        done = python.run(["-m", "minifaas.commands.main", "plan"], cwd=..., env=..., timeout=600)
        server = python.start(["-m", "minifaas.commands.main", "serve"], cwd=..., env=..., stdout=fd, stderr=fd)
        exe = python.interpreter()  # for a program that starts ``python`` processes of its own

``interpreter()`` is an executable that stands in for ``python``: ``exe ARGV``
is a small client (no torch) that has the server fork ``python ARGV`` with the
client's own stdin, stdout, stderr, working directory and environment, waits for
it, and exits as it did. Signals it gets go on to the command, and the command
is killed if the client is.

A command runs with the environment it is given, plus the variables the
imports set (as a fresh interpreter would have them: TORCHINDUCTOR_CACHE_DIR).
The server dies with the process that started it.

Protocol: a SOCK_SEQPACKET socket, one JSON request per message with four
descriptors attached (the child's stdin, stdout, stderr and a status socket),
and a fifth from a client: the read end of a pipe whose other end only the
client holds, so its end of file means the client has gone. The status
socket carries ``{"pid": N}`` once the child runs and ``{"code": C}`` when it
has ended (its returncode as ``subprocess`` writes it). Requests come on the
control socket of the test process and on a listening socket in a private
folder, one connection per client.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import io
import json
import os
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import IO

from minifaas.parent_watch import child_env, die_with_parent

READY_TIMEOUT_S = 300.0  # the imports: seconds on a quiet machine, far more on a loaded one
_FDS = 5  # at most: stdin, stdout, stderr, status, and a client's lifeline


class Forked:
    """A command forked by the server: what the tests use of a ``subprocess.Popen``."""

    def __init__(self, args: list[str], status: socket.socket, captured: list[IO[bytes]]) -> None:
        self.args = args
        self._status = status
        self._captured = captured  # the files its stdout and stderr go to, unless the caller gave its own
        self.returncode: int | None = None
        self.pid = self._message(None)["pid"]

    def _message(self, timeout: float | None) -> dict:
        self._status.settimeout(timeout)
        try:
            data = self._status.recv(4096)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
        if not data:
            raise RuntimeError(f"the pre-loaded server went away while running {self.args}")
        return json.loads(data)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._message(timeout)["code"]
            self._status.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for it to end; what it wrote to the stdout and stderr captured for it."""
        self.wait(timeout)
        texts = []
        for f in self._captured:
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
            f.close()
        return texts[0], texts[1]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Preloaded:
    """One pre-loaded server and the commands it forks (use it as a context manager)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._folder = tempfile.TemporaryDirectory(prefix="preloaded-")
        self.address = os.path.join(self._folder.name, "server")  # where clients connect
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.address)
        listener.listen()
        fds = (theirs.fileno(), listener.fileno())
        self._server = subprocess.Popen(
            [sys.executable, __file__, *map(str, fds)], pass_fds=fds, env=child_env(), stdin=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        listener.close()
        self._control = ours
        ours.settimeout(READY_TIMEOUT_S)
        if ours.recv(16) != b"ready":
            raise RuntimeError("the pre-loaded server did not start")
        ours.settimeout(None)

    def start(
        self,
        argv: list[str],
        *,
        cwd: Path,
        env: dict[str, str],
        stdout: int | None = None,
        stderr: int | None = None,
        new_session: bool = False,
    ) -> Forked:
        """Fork ``python ARGV`` (``argv`` as after the interpreter: ``-m module ...`` or ``script ...``), its
        stdout and stderr to these descriptors, or captured for ``communicate`` where none is given."""
        # files ``communicate`` reads and closes
        captured = [] if stdout is not None else [tempfile.TemporaryFile() for _ in range(2)]  # noqa: SIM115
        if captured:
            stdout, stderr = captured[0].fileno(), captured[1].fileno()
        status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stdin = os.open(os.devnull, os.O_RDONLY)
        try:
            request = {"argv": argv, "cwd": str(cwd), "env": env, "new_session": new_session}
            fds = array.array("i", [stdin, stdout, stderr, theirs.fileno()])
            self._control.sendmsg([json.dumps(request).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        finally:
            os.close(stdin)
            theirs.close()
        return Forked([sys.executable, *argv], status, captured)

    def run(self, argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """Like ``subprocess.run(capture_output=True, text=True, timeout=...)`` on ``python ARGV``."""
        child = self.start(argv, cwd=cwd, env=env)
        try:
            out, err = child.communicate(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise
        return subprocess.CompletedProcess(child.args, child.wait(), out, err)

    def interpreter(self) -> Path:
        """An executable to use in place of ``python``: ``EXE ARGV`` runs as ``python ARGV`` would, forked
        from this server (the module docstring says how)."""
        path = Path(self._folder.name) / "python"
        if not path.exists():
            client = shlex.join([sys.executable, __file__, "--connect", self.address])
            path.write_text(f'#!/bin/sh\nexec {client} "$@"\n')
            path.chmod(0o755)
        return path

    def close(self) -> None:
        self._control.close()  # the server exits at the end of its control socket
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        self._folder.cleanup()

    def __enter__(self) -> Preloaded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----- the server, in its own process -----


def _preload() -> dict[str, str]:
    """Import what the commands import; returns the variables the imports set."""
    before = dict(os.environ)
    from minifaas.launch import zygote
    from minifaas.model.loader import DEFAULT_MODEL

    zygote.preload(DEFAULT_MODEL)  # what a CPU worker imports, the kernels chosen first, as every CPU command does
    import minifaas.commands.main
    import minifaas.gateway.gateway
    import minifaas.sim.engine  # noqa: F401

    return {k: v for k, v in os.environ.items() if before.get(k) != v}


def _serve(control: socket.socket, listener: socket.socket) -> tuple[dict, list[int]] | None:
    """Fork a child per request; returns in the child, with its request and descriptors, and None in
    the server once its control socket has closed."""
    from minifaas.launch import zygote  # imported already (``_preload``)

    statuses: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(listener, selectors.EVENT_READ)
    while True:
        ready = selector.select(timeout=0.05)  # a child's end is reported within 50 ms
        while statuses:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            with statuses.pop(pid) as sock, contextlib.suppress(OSError):  # its client may be gone (killed)
                sock.send(json.dumps({"code": zygote.returncode(status)}).encode())
        for key, _ in ready:
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is listener:
                selector.register(listener.accept()[0], selectors.EVENT_READ)  # a client
                continue
            received = zygote.receive(sock, _FDS)  # the same framing as the workers' parent
            if received is None:
                if sock is control:
                    return None
                selector.unregister(sock)  # a client that has sent its request and gone
                sock.close()
                continue
            request, fds = received
            pid = os.fork()
            if pid == 0:
                for key in list(selector.get_map().values()):
                    key.fileobj.close()  # type: ignore[union-attr]
                selector.close()
                for other in statuses.values():
                    other.close()
                return request, fds
            status_sock = socket.socket(fileno=fds[3])
            for fd in fds[:3] + fds[4:]:
                os.close(fd)
            with contextlib.suppress(OSError):
                status_sock.send(json.dumps({"pid": pid}).encode())
            statuses[pid] = status_sock


def _become(request: dict, fds: list[int], added: dict[str, str]) -> None:
    """In the child: take the descriptors and the environment, and be ``python ARGV``. Never returns."""
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    os.close(fds[3])  # the server reports this child's end; nothing is sent from here
    if len(fds) > 4:  # a client's: the command dies with it
        os.set_inheritable(fds[4], False)
        threading.Thread(target=_die_with_client, args=(fds[4],), daemon=True).start()
    if request["new_session"]:
        os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**request["env"], **added})
    sys.stdin, sys.stdout, sys.stderr = _stdio(0), _stdio(1), _stdio(2)
    import numpy

    numpy.random.seed()  # a fresh interpreter's global generator is seeded from the OS, not copied
    code = _run_as_main(request["argv"])
    # then end as python ends, but without tearing down the modules (torch's alone takes a second and
    # would be paid per command): non-daemon threads joined, exit handlers run, streams flushed
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _die_with_client(lifeline: int) -> None:
    os.read(lifeline, 1)  # nothing is ever written: this returns at the end of file, when the client has gone
    os.kill(os.getpid(), signal.SIGKILL)


def _run_as_main(argv: list[str]) -> int:
    """``python ARGV`` in this process; its exit status."""
    import runpy

    try:
        if argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
            sys.modules.pop(argv[1], None)  # run afresh as __main__, as ``python -m`` does, not the imported copy
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv, sys.path[0] = list(argv), os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # as the interpreter reads it
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _stdio(fd: int) -> io.TextIOWrapper:
    """A standard stream on ``fd`` as a fresh interpreter makes it (PYTHONUNBUFFERED read now)."""
    unbuffered = fd and bool(os.environ.get("PYTHONUNBUFFERED"))
    raw = io.FileIO(fd, "w" if fd else "r", closefd=False)
    buffer = raw if unbuffered else (io.BufferedWriter(raw) if fd else io.BufferedReader(raw))
    return io.TextIOWrapper(
        buffer, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
        line_buffering=fd == 2 or raw.isatty(), write_through=unbuffered,
    )  # fmt: skip


def _client(address: str, argv: list[str]) -> None:
    """``python ARGV`` forked by the server at ``address``, with this process's stdio, folder and
    environment; exits as the command did. Never returns."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.connect(address)
    status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lifeline, _held = os.pipe()  # the write end stays open here until this process ends
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "new_session": False}
    fds = array.array("i", [0, 1, 2, theirs.fileno(), lifeline])
    server.sendmsg([json.dumps(request).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    theirs.close()
    os.close(lifeline)
    server.close()
    pid = json.loads(status.recv(4096))["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda sig, _frame: os.kill(pid, sig))
    ended = status.recv(4096)
    code = json.loads(ended)["code"] if ended else 1
    if code < 0:  # killed by a signal: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def main() -> None:
    if sys.argv[1] == "--connect":
        _client(sys.argv[2], sys.argv[3:])
    control, listener = (socket.socket(fileno=int(fd)) for fd in sys.argv[1:3])
    die_with_parent()  # ends with the test process that started it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is for the test run
    added = _preload()
    control.send(b"ready")
    forked = _serve(control, listener)
    if forked is None:
        os._exit(0)  # at once: tearing down torch's modules serves nothing
    _become(*forked, added)


if __name__ == "__main__":
    main()
