"""Workers as Ray actors, each on a node that holds its cluster's custom resource (the ``ray`` extra).

    ray start --head --resources '{"pd": 4}'                   # the PD site's nodes
    ray start --address HEAD:6379 --resources '{"prfaas": 2}'  # the PrfaaS site's nodes
    minifaas serve --launcher ray --ray-address HEAD:6379      # --ray-address local: a one-machine Ray

Each cluster's workers are reserved together in a placement group before any actor starts, so a cluster that
does not fit is one clear error. The cluster secret reaches the actors in their runtime environment: whoever
can reach the Ray cluster can run code on its nodes.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import threading
from collections import Counter

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from minifaas.config import RayConfig
from minifaas.control.secret import SECRET_ENV
from minifaas.launch.launcher import WORKER_COMMAND, WorkerError, WorkerSpec
from minifaas.net.address import Address
from minifaas.worker.worker_process import serve

log = logging.getLogger("minifaas.gateway")


class WorkerActor:
    """One worker inside a Ray actor: ``worker_process.serve`` on its own loop, in a thread of the actor's process."""

    def __init__(self, argv: list[str]) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self._ready = threading.Event()
        self._announced: dict = {}
        self._error = ""
        flags = importlib.import_module(WORKER_COMMAND)  # the worker's own flags, as its command reads them
        args = flags.parse_args([*argv, "--listen", f"{ray.util.get_node_ip_address()}:0"])
        logging.getLogger().setLevel(args.log_level)
        threading.Thread(target=self._run, args=(args,), name="minifaas-worker", daemon=True).start()

    def _run(self, args: object) -> None:
        try:
            asyncio.run(serve(args, self._announce))  # type: ignore[arg-type]
        except BaseException as e:  # reported through address(); a worker that served once is restarted
            self._error = f"{type(e).__name__}: {e}"
            log.exception("worker failed")
        if self._announced:
            os._exit(1)  # the worker is gone: let Ray restart the actor
        self._ready.set()

    def _announce(self, ready: dict) -> None:
        self._announced = ready
        self._ready.set()

    def address(self) -> list:
        self._ready.wait()
        if not self._announced:
            raise RuntimeError(f"the worker did not start: {self._error}")
        return self._announced["control"]

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


class RayLauncher:
    sees_exits = False  # Ray restarts an actor's process where this process cannot see it end

    def __init__(self, config: RayConfig, secret: bytes, specs: list[WorkerSpec]) -> None:
        self.config, self.secret = config, secret
        self.sizes = Counter(s.cluster for s in specs if s.address is None)  # bundles per cluster
        self.gpus = {s.cluster: s.gpus for s in specs if s.address is None}
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.groups: dict[str, PlacementGroup] = {}
        self.bundles: dict[str, tuple[str, int]] = {}  # worker -> (cluster, bundle index)
        self._started_ray = False

    async def __aenter__(self) -> RayLauncher:
        if not ray.is_initialized():
            c = self.config
            local = {"resources": dict(self.sizes), "num_cpus": self._local_cpus()} if c.address == "local" else {}
            # on this thread: Ray's driver state belongs to the thread that made it (seconds, before serving)
            try:
                ray.init(address=c.address, namespace=c.namespace, **local)
            except ConnectionError as e:  # no cluster where it was told to look
                raise WorkerError(f"no Ray cluster at {c.address!r} ({e}); `ray start --head` starts one, "
                                  "--ray-address local one inside this process") from None  # fmt: skip
            self._started_ray = True
        try:
            for cluster, n in self.sizes.items():
                self.groups[cluster] = await self._reserve(cluster, n)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for name in list(self.actors):
            ray.kill(self.actors.pop(name), no_restart=True)
        for group in self.groups.values():
            remove_placement_group(group)
        self.groups.clear()
        if self._started_ray:
            ray.shutdown()

    def _local_cpus(self) -> int:
        return max(os.cpu_count() or 1, int(sum(self.sizes.values()) * self.config.cpus_per_worker + 0.999))

    def _bundle(self, cluster: str) -> dict[str, float]:
        gpus = self.gpus.get(cluster, 0.0)
        return {cluster: 1.0, "CPU": self.config.cpus_per_worker, **({"GPU": gpus} if gpus else {})}

    async def _reserve(self, cluster: str, n: int) -> PlacementGroup:
        bundle = self._bundle(cluster)
        group = placement_group([bundle] * n, strategy="PACK", name=f"minifaas-{cluster}")
        try:
            await asyncio.wait_for(group.ready(), self.config.start_timeout)
        except TimeoutError:
            remove_placement_group(group)
            raise WorkerError(
                f"the Ray cluster has no room for {n} {cluster} worker(s) of {bundle} each within "
                f"{self.config.start_timeout:.0f} s: give its nodes the resource "
                f"(ray start --resources '{{\"{cluster}\": {n}}}')"
            ) from None
        return group

    def _free_bundle(self, cluster: str) -> int:
        taken = {i for c, i in self.bundles.values() if c == cluster}
        return next(i for i in range(self.sizes[cluster]) if i not in taken)

    async def start(self, spec: WorkerSpec) -> Address:
        actor = self.actors.get(spec.name)
        if actor is None:
            index = self._free_bundle(spec.cluster)
            bundle = self._bundle(spec.cluster)
            actor = (
                ray.remote(WorkerActor)
                .options(
                    name=spec.name,
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    resources={spec.cluster: 1.0},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.groups[spec.cluster], index),
                    max_restarts=-1,
                    max_task_retries=-1,
                    runtime_env={"env_vars": {SECRET_ENV: self.secret.decode()}},
                )
                .remote(["--role", spec.role, "--cluster", spec.cluster, "--name", spec.name, *spec.argv])
            )
            self.actors[spec.name], self.bundles[spec.name] = actor, (spec.cluster, index)
        try:
            host, port = await asyncio.wait_for(actor.address.remote(), self.config.start_timeout)
        except (RayActorError, RuntimeError, TimeoutError, GetTimeoutError) as e:
            raise WorkerError(f"worker {spec.name} did not start as a Ray actor: {e}") from None
        return host, int(port)

    async def stop(self, spec: WorkerSpec) -> None:
        actor = self.actors.pop(spec.name, None)
        self.bundles.pop(spec.name, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    def exit_of(self, spec: WorkerSpec, pid: int) -> int | None:
        return None
