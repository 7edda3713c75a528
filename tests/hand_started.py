"""Hand-started workers for tests: ``minifaas worker`` processes, as an operator would run them on their hosts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from minifaas.control.secret import SECRET_ENV

MODEL = ("--model", "kimi-linear-tiny")


def write_secret(directory: Path) -> Path:
    path = directory / "cluster.key"
    path.write_text("test-cluster-secret-0123456789abcdef\n")
    path.chmod(0o600)
    return path


class HandStarted:
    """One worker process; ``prefix`` runs it elsewhere (``ip netns exec NS``)."""

    def __init__(self, argv: Sequence[str], log: Path, prefix: Sequence[str] = ()) -> None:
        # one torch thread each: a test's workers share this machine's cores, and torch's default of a thread
        # per core in each would spin them against each other in every forward
        self.argv = [*prefix, sys.executable, "-m", "minifaas.commands.main", "worker", *MODEL, "--threads", "1", *argv]
        self.log_path = log
        self.process: subprocess.Popen | None = None
        self.ready: dict = {}

    def start(self) -> HandStarted:
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}  # the secret comes from --secret-file
        log = self.log_path.open("a")
        self.process = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        log.close()
        return self

    def wait_ready(self) -> dict:
        assert self.process is not None and self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited before it was ready:\n{self.log_path.read_text()[-3000:]}")
        self.ready = json.loads(line)
        return self.ready

    @property
    def pid(self) -> int:
        return self.ready["pid"]

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 20 s; the exit code of a process that was still running."""
        p = self.process
        if p is None or p.poll() is not None:
            return None
        p.send_signal(signal.SIGCONT)  # a stopped worker cannot act on SIGTERM
        p.terminate()  # ``ip netns exec`` execs the worker: one process, one pid
        try:
            return p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait()


def start_all(workers: Sequence[HandStarted]) -> None:
    """Start every worker at once (their models load in parallel), then wait for each."""
    for w in workers:
        w.start()
    for w in workers:
        w.wait_ready()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
