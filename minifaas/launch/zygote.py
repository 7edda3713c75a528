"""A pre-loaded parent that forks local CPU workers, so each one skips the imports.

It imports what a CPU worker imports, then forks a whole worker process per request; nothing here runs a torch
op, a thread or an event loop before a fork. The gateway's end, ``forked.ForkServer``, talks to it over:

    control socket, gateway -> here   {"id": 3, "argv": [...], "env": {...}}, the child's stdin and stdout
                                      attached (SCM_RIGHTS); this process exits when the socket closes
    stdout, here -> gateway           {"ready": pid} once imported; {"id": 3, "pid": 4242} (or "error")
                                      per request; {"exit": 4242, "code": -9} as a child ends (subprocess's
                                      returncode)
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import traceback

from minifaas.launch.launcher import WORKER_COMMAND
from minifaas.parent_watch import die_with_parent
from minifaas.proctitle import set_title

MAX_MESSAGE = 1 << 20


def preload(model: str) -> None:
    """Import what a CPU worker of ``model`` will import, without building anything."""
    from minifaas.model.kernels import select_kernels

    select_kernels("cpu")  # before any model code, as in the worker
    import minifaas.worker.worker_process  # noqa: F401  # torch, transformers, the transport, the services

    try:  # the model's own modeling module (transformers imports it lazily, on first use)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        from minifaas.model.loader import ModelSpec, load_config

        spec = ModelSpec.resolve(model)
        if spec.kind != "config":
            MODEL_FOR_CAUSAL_LM_MAPPING[type(load_config(spec))]
    except Exception:  # remote code, an odd config: the child imports it itself
        pass


def receive(sock: socket.socket, descriptors: int = 2) -> tuple[dict, list[int]] | None:
    """One request and the descriptors attached to it (two here: a child's stdin and stdout); None once
    the other end has closed the socket."""
    fds = array.array("i")
    message, ancillary, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_LEN(descriptors * fds.itemsize))
    if not message:
        return None
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return json.loads(message), list(fds)


def child(argv: list[str], env: dict[str, str], stdin: int, stdout: int, control: socket.socket) -> None:
    """In the forked child: become the worker. Never returns."""
    code = 1
    try:
        control.close()
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.close(stdin)
        os.close(stdout)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored only in the parent
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["minifaas worker", *argv]
        set_title("worker")  # not a second zygote in ps; the worker names its role as it starts
        runpy.run_module(WORKER_COMMAND, run_name="__main__", alter_sys=True)  # as ``python -m`` runs it
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # a worker that crashes says why, as a fresh one would
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def say(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def reap() -> None:
    with contextlib.suppress(ChildProcessError):  # no child left
        while (ended := os.waitpid(-1, os.WNOHANG))[0]:
            say({"exit": ended[0], "code": returncode(ended[1])})


def serve_forks(control: socket.socket) -> None:
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    while True:
        ready = selector.select(timeout=0.2)  # a child's end is noticed within 0.2 s
        reap()
        if not ready:
            continue
        received = receive(control)
        if received is None:
            return
        request, fds = received
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            say({"id": request.get("id"), "error": f"expected 2 descriptors, got {len(fds)}"})
            continue
        sys.stdout.flush()  # nothing buffered may be written twice
        pid = os.fork()
        if pid == 0:
            child(request["argv"], request["env"], fds[0], fds[1], control)
        for fd in fds:
            os.close(fd)  # the child's alone now: its stdin closes when the gateway closes its end
        say({"id": request["id"], "pid": pid})


def main() -> None:
    fd, model = int(sys.argv[1]), sys.argv[2]
    tie_to_gateway()
    preload(model)
    run(socket.socket(fileno=fd))


def tie_to_gateway() -> None:
    """Ignore a terminal's ^C (the gateway's to handle) and die with the gateway, whose child this is; its
    workers die with this one (theirs is this one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()


def run(control: socket.socket) -> None:
    """Serve fork requests once the imports are done (``preload`` here, or in the process this one was
    forked from: ``forked.start_here``). Never returns."""
    set_title("zygote")
    say({"ready": os.getpid()})
    serve_forks(control)
    os._exit(0)  # at once: tearing down torch and transformers' modules takes a second and serves nothing


if __name__ == "__main__":
    main()
