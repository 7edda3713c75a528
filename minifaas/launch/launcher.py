"""Three launchers behind one small interface: start a worker and say where it listens, stop it.

    address = await launcher.start(spec)   # the worker running (started if it was not): its control port
    await launcher.stop(spec)              # stopped for good, if it is the launcher's to stop

When the gateway loses a worker's session it calls ``start`` again: restarts are the launcher's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from minifaas.net.address import Address

# the worker's program, by module: ``python -m`` it, or run it in a pre-loaded child (``zygote``)
WORKER_COMMAND = "minifaas.commands.worker"


class WorkerError(RuntimeError):
    """A worker could not be started or attached."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker the gateway wants. A hand-started one has an ``address``, and says its own name and role."""

    name: str  # "" for a hand-started worker: it names itself when it attaches
    role: str  # "prefill" or "decode"; "" for a hand-started PD worker, whose own flags decide
    cluster: str  # "prfaas" or "pd"
    argv: tuple[str, ...] = ()  # the worker's flags (model, device, cache, ...) for one the gateway starts
    address: Address | None = None  # a hand-started worker's control port
    gpus: float = 0.0  # GPUs the worker uses (Ray reserves them)
    device: str = "cpu"  # where it runs, as the gateway's host numbers its GPUs (a new role keeps it)
    env: tuple[tuple[str, str], ...] = ()  # set in its environment by a local launcher (CUDA_VISIBLE_DEVICES)

    @property
    def label(self) -> str:
        """How logs name the worker before it has said its name."""
        if self.name or self.address is None:
            return self.name or f"a {self.cluster} worker"
        return f"the {self.cluster} worker at {self.address[0]}:{self.address[1]}"


class Launcher(Protocol):
    sees_exits: bool  # whether ``exit_of`` can ever know how a worker's process ended

    async def start(self, spec: WorkerSpec) -> Address: ...

    async def stop(self, spec: WorkerSpec) -> None: ...

    def exit_of(self, spec: WorkerSpec, pid: int) -> int | None:
        """How the worker's process ``pid`` ended, if this launcher saw it end: its returncode (negative: the
        signal that ended it); None while it runs, or when its end was not seen here."""
        ...


class AttachedLauncher:
    """Workers someone else runs: the gateway only ever dials them."""

    sees_exits = False

    async def start(self, spec: WorkerSpec) -> Address:
        if spec.address is None:
            raise WorkerError(f"{spec.label}: a hand-started worker needs an address")
        return spec.address

    async def stop(self, spec: WorkerSpec) -> None:
        """Nothing: the worker outlives the gateway and waits for the next one."""

    def exit_of(self, spec: WorkerSpec, pid: int) -> int | None:
        return None  # another host's process
