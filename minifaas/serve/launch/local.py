"""The default launcher: every worker a child process of the gateway, on this host.

A child runs ``python -m minifaas.serve.worker --exit-with-stdin`` with the
cluster secret in its environment, listens on 127.0.0.1 (control on any free
port, KV on a port fixed per worker name, so a restarted worker is found where
the link emulator's route points) and prints one JSON line when ready. It
exits when its stdin closes and is killed by the kernel when the gateway
dies (``minifaas.parent_watch``), so a gateway that dies, however it dies,
leaves no worker behind.

``start`` of a worker whose process still runs returns the address it has:
one that is only slow (stopped, overloaded) is re-attached, not replaced.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys

from minifaas.child_process import describe_exit, wait_or_kill
from minifaas.control.secret import SECRET_ENV
from minifaas.parent_watch import child_env
from minifaas.serve.launch.launcher import Address, WorkerError, WorkerSpec

log = logging.getLogger("minifaas.gateway")
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class LocalLauncher:
    def __init__(self, secret: bytes, start_timeout: float = 300.0) -> None:
        self.secret, self.start_timeout = secret, start_timeout
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.addresses: dict[str, Address] = {}
        self.kv_ports: dict[str, int] = {}  # chosen at the first start, kept across restarts
        self.starts: dict[str, int] = {}
        self.restarts: dict[str, int] = {}  # started again after the process died

    async def __aenter__(self) -> LocalLauncher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """No child outlives the gateway, whatever the pool did or did not stop."""
        await asyncio.gather(*(self.stop(WorkerSpec(name, "", "")) for name in list(self.processes)))

    def alive(self, spec: WorkerSpec) -> bool:
        p = self.processes.get(spec.name)
        return p is not None and p.returncode is None

    async def start(self, spec: WorkerSpec) -> Address:
        if self.alive(spec):
            return self.addresses[spec.name]
        dead = self.processes.get(spec.name)
        if dead is not None:
            log.error("worker %s died (%s): restarting it", spec.name, describe_exit(dead.returncode))
            self.restarts[spec.name] = self.restarts.get(spec.name, 0) + 1
        await self.stop(spec)
        kv_port = self.kv_ports.setdefault(spec.name, free_port())
        argv = [sys.executable, "-m", "minifaas.serve.worker", "--role", spec.role, "--cluster", spec.cluster]
        argv += ["--name", spec.name, "--listen", f"{HOST}:0", "--kv-listen", f"{HOST}:{kv_port}", "--exit-with-stdin"]
        env = child_env({**os.environ, SECRET_ENV: self.secret.decode()})
        process = await asyncio.create_subprocess_exec(
            *argv, *spec.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env
        )
        self.processes[spec.name] = process
        try:
            async with asyncio.timeout(self.start_timeout):
                ready = json.loads(await process.stdout.readline())  # type: ignore[union-attr]
        except (TimeoutError, json.JSONDecodeError) as e:
            await self.stop(spec)
            raise WorkerError(f"worker {spec.name} did not start: {e!r}") from None
        self.starts[spec.name] = self.starts.get(spec.name, 0) + 1
        self.addresses[spec.name] = (HOST, ready["control"][1])
        log.info("worker %s (%s, %s) started, pid %s", spec.name, spec.role, spec.cluster, ready["pid"])
        return self.addresses[spec.name]

    async def stop(self, spec: WorkerSpec) -> None:
        p = self.processes.pop(spec.name, None)
        if p is None or p.returncode is not None:
            return
        if p.stdin is not None:
            p.stdin.close()  # the worker exits when its stdin closes
        await wait_or_kill(p, grace=5)
