"""The default launcher: every worker a child process of the gateway, on this host.

A child listens on 127.0.0.1, prints one JSON line when ready, and exits when its stdin closes or the gateway
dies. CPU workers are forked from a pre-loaded parent (``forked``); on CUDA, or when that parent fails, a worker
is a fresh interpreter. A restart keeps the worker's KV port, where the link emulator's route points.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

from minifaas.child_process import describe_exit, wait_or_kill
from minifaas.control.secret import SECRET_ENV
from minifaas.launch import forked
from minifaas.launch.forked import ForkedProcess, ForkError, ForkServer
from minifaas.launch.launcher import WORKER_COMMAND, WorkerError, WorkerSpec
from minifaas.net.address import Address
from minifaas.parent_watch import child_env

log = logging.getLogger("minifaas.gateway")
HOST = "127.0.0.1"
KEPT_EXITS = 1024  # exit statuses of ended worker processes kept for the migration seam to ask


def on_cpu(spec: WorkerSpec) -> bool:
    argv = list(spec.argv)
    return "--device" not in argv or argv[argv.index("--device") + 1] == "cpu"


class LocalLauncher:
    sees_exits = True  # its own children's (a forked worker whose parent was lost ends unseen: ``exit_seen``)

    def __init__(self, secret: bytes, start_timeout: float = 300.0, model: str | None = None) -> None:
        """``model``: fork CPU workers from a parent that has imported its code (None: every worker fresh)."""
        self.secret, self.start_timeout, self.model = secret, start_timeout, model
        self.forks: ForkServer | None = None
        self.processes: dict[str, asyncio.subprocess.Process | ForkedProcess] = {}
        self.addresses: dict[str, Address] = {}
        self.kv_ports: dict[str, int] = {}  # chosen at the first start, kept across restarts
        self.restarts: dict[str, int] = {}  # started again after the process died
        self.exits: dict[int, int] = {}  # pid -> returncode of each worker process seen to end

    async def __aenter__(self) -> LocalLauncher:
        if self.model is not None:
            self.forks = forked.acquire(self.model)  # a new one imports while the gateway sets up the rest
        return self

    async def __aexit__(self, *exc: object) -> None:
        """No child outlives the gateway, whatever the pool did or did not stop."""
        await asyncio.gather(*(self.stop(WorkerSpec(name, "", "")) for name in list(self.processes)))
        if self.forks is not None:
            forked.release(self.forks)
            self.forks = None

    def alive(self, spec: WorkerSpec) -> bool:
        p = self.processes.get(spec.name)
        return p is not None and p.returncode is None

    def exit_of(self, spec: WorkerSpec, pid: int) -> int | None:
        p = self.processes.get(spec.name)
        return exit_seen(p) if p is not None and p.pid == pid else self.exits.get(pid)

    async def start(self, spec: WorkerSpec) -> Address:
        if self.alive(spec):
            return self.addresses[spec.name]
        dead = self.processes.get(spec.name)
        if dead is not None:
            log.error("worker %s died (%s): restarting it", spec.name, describe_exit(dead.returncode))
            self.restarts[spec.name] = self.restarts.get(spec.name, 0) + 1
        await self.stop(spec)
        kv_port = self.kv_ports.get(spec.name, 0)  # the first start binds any free port; restarts keep it
        flags = ["--role", spec.role, "--cluster", spec.cluster, "--name", spec.name, "--listen", f"{HOST}:0"]
        flags += ["--kv-listen", f"{HOST}:{kv_port}", "--exit-with-stdin", *spec.argv]
        env = child_env({**os.environ, SECRET_ENV: self.secret.decode(), **dict(spec.env)})
        process = self.processes[spec.name] = await self._spawn(spec, flags, env)
        line = b""
        try:
            async with asyncio.timeout(self.start_timeout):
                line = await process.stdout.readline()  # type: ignore[union-attr]
            ready = json.loads(line)
        except (TimeoutError, json.JSONDecodeError) as e:
            await self.stop(spec)
            why = f"it exited before it was ready ({describe_exit(process.returncode)})" if not line else repr(e)
            raise WorkerError(f"worker {spec.name} did not start: {why}") from None
        if ready.get("kv"):
            self.kv_ports[spec.name] = ready["kv"][1]  # where the link's routes and cache moves will point
        self.addresses[spec.name] = (HOST, ready["control"][1])
        log.info("worker %s (%s, %s) started, pid %s", spec.name, spec.role, spec.cluster, ready["pid"])
        return self.addresses[spec.name]

    async def _spawn(
        self, spec: WorkerSpec, flags: list[str], env: dict[str, str]
    ) -> asyncio.subprocess.Process | ForkedProcess:
        forks = self.forks
        if forks is not None and on_cpu(spec):
            try:
                return await forks.spawn(flags, env)
            except ForkError as e:  # this one starts fresh; the next ones fork from a new parent
                log.warning("%s: %s; starting it as a fresh process, and a new pre-loaded parent", spec.name, e)
                if self.forks is forks:
                    forked.release(forks)
                    self.forks = forked.acquire(forks.model)
        argv = [sys.executable, "-m", WORKER_COMMAND, *flags]
        pipe = asyncio.subprocess.PIPE
        return await asyncio.create_subprocess_exec(*argv, stdin=pipe, stdout=pipe, env=env)

    async def stop(self, spec: WorkerSpec) -> None:
        p = self.processes.pop(spec.name, None)
        if p is not None and (code := exit_seen(p)) is not None:
            self.exits[p.pid] = code  # for a request that asks how it ended after its successor started
            if len(self.exits) > KEPT_EXITS:  # the oldest first: a server that runs for months restarts many
                del self.exits[next(iter(self.exits))]
        if p is None or p.returncode is not None:
            return
        if p.stdin is not None:
            p.stdin.close()  # the worker exits when its stdin closes
        await wait_or_kill(p, grace=5)


def exit_seen(p: asyncio.subprocess.Process | ForkedProcess) -> int | None:
    """The process's returncode, if its end was seen (a forked worker whose parent was lost ends unseen)."""
    return p.returncode if not isinstance(p, ForkedProcess) or p.reaped_here else None
