"""The gateway: one asyncio program that attaches to both clusters and runs every request through them.

It builds and runs the parts: ``Workers`` (started, attached, supervised), the ``InterClusterLink``,
``PrefillDispatch``, the ``RoleChanger`` and the ``LiveScheduler``; a request's life is ``Serving.stream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from minifaas.cache.prefix_index import PrefixDirectory
from minifaas.config import ServeConfig
from minifaas.control.heartbeat import HeartbeatConfig
from minifaas.control.worker_ops import Aborted, ReplyMessage
from minifaas.gateway.inter_cluster_link import InterClusterLink
from minifaas.gateway.live_scheduler import LiveScheduler
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.prefill_dispatch import PrefillDispatch
from minifaas.gateway.requests import Admission
from minifaas.gateway.roles import RoleChanger
from minifaas.gateway.serving import Serving
from minifaas.gateway.worker_handle import WorkerHandle
from minifaas.gateway.workers import Workers, cluster_secret, make_launcher
from minifaas.launch.startup import StartupListener
from minifaas.launch.worker_specs import planned_specs
from minifaas.model.kv_size import kv_profile
from minifaas.model.loader import ModelSpec, load_config, load_config_dict, load_tokenizer
from minifaas.model.state_layout import layout_of, needs_snapshot
from minifaas.model.tokenizer import Tokenizer
from minifaas.policy.interfaces import RoutingPolicy
from minifaas.policy.plugin import ROUTER, building, load_policy
from minifaas.policy.router import Router, RouterConfig

log = logging.getLogger("minifaas.gateway")


class Gateway:
    def __init__(
        self, config: ServeConfig, metrics: ServeMetrics | None = None, on_startup: StartupListener | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics or ServeMetrics()
        spec = ModelSpec.resolve(config.model, config.seed)
        self.model_name = spec.name
        self.tokenizer: Tokenizer = load_tokenizer(spec, config.trust_remote_code)
        self.max_context = int(load_config_dict(spec).get("max_position_embeddings", 32768))
        # a transfer's state sizes, in the dtype the workers run (one for both clusters)
        self.kv_profile = kv_profile(load_config_dict(spec), spec.name, config.worker_dtype("prfaas"))
        routing = RouterConfig(
            cross_cluster_cache_move=config.cache.moves, incremental_transfer=config.cache.incremental_transfer,
            spill_tokens=config.spill_tokens, max_link_backlog_s=config.max_link_backlog_s,
        )  # fmt: skip
        with building(ROUTER, config.router):
            self.router: RoutingPolicy = (
                Router(**{"config": routing, **dict(config.router_args)}) if config.router == "default"
                else load_policy(config.router, ROUTER, config.router_args, config=routing)
            )  # fmt: skip
        self.secret = cluster_secret(config)
        hybrid = needs_snapshot(layout_of(load_config(spec, config.trust_remote_code)).kinds)
        self.prefixes = PrefixDirectory(config.cache.enabled, config.cache.block_size, spec.name, hybrid, ())
        heartbeat = HeartbeatConfig(config.heartbeat_s, config.heartbeat_deadline_s)
        self.link = InterClusterLink(config.link, config.link_emulated, config.cache.moves, heartbeat)
        self.link.secret = self.secret
        self.launcher = make_launcher(config, self.secret)
        self.pool = Workers(
            planned_specs(config), self.launcher, self.secret, spec.name, heartbeat, self.link,
            self.prefixes, start_timeout=config.ray.start_timeout if config.launcher == "ray" else 300.0,
        )  # fmt: skip
        self.pool.on_unclaimed = self._unclaimed
        self.pool.on_attached = self._attached
        self.pool.on_startup = self.link.on_startup = on_startup  # told of each process __aenter__ starts
        self.roles = RoleChanger(self.pool, config, self.metrics)
        self.scheduler = LiveScheduler(self.pool, self.link, config, self.metrics, self.roles, self.max_context)
        self.dispatch = PrefillDispatch(
            self.pool, self.link, self.prefixes, self.metrics, config, self.scheduler, self.kv_profile
        )
        self.admission = Admission.of(config)  # the queue's bounds: count, memory, the first-token deadline
        self.serving = Serving(
            config, self.tokenizer, self.router, self.pool, self.link, self.prefixes, self.scheduler, self.dispatch,
            self.admission, self.metrics,
        )  # fmt: skip
        self.stream = self.serving.stream  # a request's life: token events until one carries a finish_reason
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Gateway:
        try:
            await self._stack.enter_async_context(self.link)  # last out: the workers stop before their link
            await self._stack.enter_async_context(self.launcher)  # whatever its workers left, it ends
            await self._stack.enter_async_context(self.pool)
            self._stack.push_async_callback(self.roles.cancel)
            self.scheduler.prepare()
            tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
            self._stack.callback(self._stop_sampling)
            self._sampling = tasks.create_task(self.scheduler.run())
        except BaseException:
            await self._stack.aclose()
            raise
        self.pool.on_startup = self.link.on_startup = None  # from now on restarts and role changes are logged
        moving = "fixed (--fixed-threshold)" if self.config.fixed_threshold else "moved by the link's use from now on"
        where = "emulated" if self.link.emulated else "the network"
        t, rule = self.scheduler.threshold, self.scheduler.rule
        log.info("gateway ready: %s; t %d, rule %s: %s; the PrfaaS link is %s",
                 ", ".join(self.pool.workers), t, rule, moving, where)  # fmt: skip
        return self

    def _stop_sampling(self) -> None:
        self.pool.closing = True
        self._sampling.cancel()

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def _attached(self, w: WorkerHandle) -> None:
        if w.cluster == "prfaas" and w.role == "prefill":  # the codecs its transfers across the link may use
            self.scheduler.calibrated(w.codecs)
        self.metrics.worker_kernels(w.name, w.kernels)

    def _unclaimed(self, w: WorkerHandle, msg: ReplyMessage) -> None:
        if isinstance(msg, Aborted):  # a prefill the gateway aborted has stopped
            req, tokens, done = msg.req, msg.tokens, msg.done_tokens
            log.info("%s stopped the prefill of %s after %d of %d tokens", w.name, req, done, tokens)
            self.metrics.prefill_stopped(w.cluster, tokens, done)

    def health(self) -> dict:
        workers = self.pool.workers
        status = {n: ("down" if not w.alive else "draining" if w.draining else "up") for n, w in workers.items()}
        healthy = any(w.alive for w in self.pool.of("pd", "decode")) and any(
            w.alive for w in workers.values() if w.role == "prefill"
        )
        links = {name: f"down: {self.link.down[name]}" if name in self.link.down else "up"
                 for name in self.link.emulators()}  # fmt: skip
        return {
            "status": "ok" if healthy and not self.link.down else "degraded",
            "healthy": healthy,
            "workers": status,
            "links": links,
            "kernels": {n: w.kernels for n, w in workers.items()},
            "threshold": self.scheduler.threshold,
            "inflight": self.admission.requests,
            "cache_moves": dict(self.dispatch.moves.counts),
            "role_changes": dict(self.roles.counts),
        }
