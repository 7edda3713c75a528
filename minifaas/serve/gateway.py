"""The gateway: one asyncio program that starts the clusters and runs every request through them.

Processes it owns (all children; none outlives it):
    PrfaaS cluster   prefill workers, remote: their KV crosses the emulated link
    PD cluster       PD-P prefill workers and PD-D decode workers, local
    link emulator    the inter-cluster link: one relay process, one route (a
                     listening port of its own) to each decode worker's KV port,
                     one pacer for all of them

A request: route (policy.router, with each prefill node's cached prefix from
the prefix directory) -> ask the decode worker to expect the state
-> ask the prefill worker to prefill and stream it (through the emulator when
it comes from PrfaaS) -> the first token goes to the client at once -> the
decode worker streams the rest. A PrfaaS prefill that fails (worker gone, link
cut or stalled, too slow) is redone on PD-P: the request still completes, and
its record says why it fell back.

Prefix caching: every prefill node keeps a pool of what it computed; the store
and evict events on its replies keep the gateway's prefix directory current, so
routing sees the incremental length and picks the node that holds the prefix.
Decode nodes keep the KV they receive, so when a PrfaaS prefill's decode node
already holds a prefix, the decode node pins it and only the rest crosses the
link. Under the ABUNDANT rule the router may ask for the longer cache of the
other cluster: its node sends that prefix's state across the link (through an
emulated link in front of the receiving prefill node) before the prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator

from minifaas.model.kv_size import kv_profile
from minifaas.model.loader import ModelSpec, load_config, load_config_dict, load_tokenizer
from minifaas.model.state_layout import StateLayout, needs_snapshot
from minifaas.model.tokenizer import Tokenizer
from minifaas.policy.router import (
    ClusterView,
    NodeView,
    Path,
    RouteDecision,
    RouteInput,
    Router,
    RouterConfig,
    Rule,
)
from minifaas.scheduler.long_term import LongTermConfig
from minifaas.scheduler.loop import LiveScheduler
from minifaas.scheduler.short_term import ShortTermConfig
from minifaas.serve.config import ServeConfig
from minifaas.serve.control import CACHE_EVENTS
from minifaas.serve.deadline import RequestDeadline
from minifaas.serve.lifecycle import Phase, advance
from minifaas.serve.metrics import ServeMetrics
from minifaas.serve.prefill_dispatch import PrefillDispatch
from minifaas.serve.prefix_directory import PrefixDirectory
from minifaas.serve.requests import (
    DeadlineExceeded,
    GenerateRequest,
    Overloaded,
    RequestFailed,
    RequestRecord,
    TokenEvent,
)
from minifaas.serve.roles import RoleChanger, plan_workers
from minifaas.serve.startup import StartupListener, reported
from minifaas.serve.token_stream import decode_tokens
from minifaas.serve.worker_handle import LOST, WorkerHandle
from minifaas.transport.emulator_control import EmulatorError, EmulatorProcess

log = logging.getLogger("minifaas.gateway")
LINK = "prfaas->pd"  # the inter-cluster link's name in /metrics and link_stats


class Gateway:
    def __init__(
        self, config: ServeConfig, metrics: ServeMetrics | None = None, on_startup: StartupListener | None = None
    ) -> None:
        self.config = config
        self.on_startup = on_startup  # told of each process __aenter__ starts; None: log lines
        self.metrics = metrics or ServeMetrics()
        self.link_stats: dict[str, dict] = {}
        spec = ModelSpec.resolve(config.model, config.seed)
        self.model_name = spec.name
        self.tokenizer: Tokenizer = load_tokenizer(spec, config.trust_remote_code)
        self.max_context = int(load_config_dict(spec).get("max_position_embeddings", 32768))
        self.kv_profile = kv_profile(load_config_dict(spec), spec.name)  # state sizes: a transfer's shape
        self.threshold = config.threshold
        self.rule = Rule(config.cache.rule)
        # the gateway works out the incremental transfer itself, per decode node (see PrefillDispatch._once)
        self.router = Router(RouterConfig(cross_cluster_cache_move=config.cache.moves, incremental_transfer=False))
        self.secret = secrets.token_bytes(32)
        self.workers = plan_workers(config, self.secret)
        self.known_names = set(self.workers)  # a name is never reused, even after its worker is retired
        hybrid = needs_snapshot(StateLayout.of(load_config(spec, config.trust_remote_code)).kinds)
        self.prefixes = PrefixDirectory(config.cache, spec.name, hybrid, self.workers)
        self.link: EmulatorProcess | None = None  # PrfaaS -> PD: every PrfaaS state crosses it
        self.link_ports: dict[str, int] = {}  # decode worker -> the link's port that leads to its KV port
        self._link_lock = asyncio.Lock()
        self.move_links: dict[str, EmulatorProcess] = {}  # the link into each prefill node, for cache moves
        self.cache_moves: Counter[str] = Counter()
        short_term = ShortTermConfig(enabled=not config.fixed_threshold, ceiling=self.max_context)
        sc = config.scheduler
        long_term = LongTermConfig(period_s=sc.period_s, min_requests=sc.min_requests, min_gain=sc.min_gain)
        self.scheduler = LiveScheduler(self, short_term, long_term if sc.enabled else None)
        self.inflight = 0
        self.fallbacks: dict[str, int] = {}
        self.transfer_ids = itertools.count(1)
        self.dispatch = PrefillDispatch(self)
        self.roles = RoleChanger(self)
        self._closing = False
        self._stack = contextlib.AsyncExitStack()
        self._tasks: asyncio.TaskGroup | None = None

    async def __aenter__(self) -> Gateway:
        self._tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._stack.push_async_callback(self._shutdown)
        try:
            async with asyncio.TaskGroup() as starting:  # one failing cancels the others
                for w in list(self.workers.values()):
                    starting.create_task(self.launch(w))
        except BaseException as e:
            await self._stack.aclose()
            if isinstance(e, BaseExceptionGroup):  # say why the first worker failed, not "a TaskGroup failed"
                raise e.exceptions[0] from None
            raise
        self.on_startup = None  # start-up is over: restarts and role changes are logged as they happen
        self._tasks.create_task(self._watch_links())
        moving = "fixed (--fixed-threshold)" if self.config.fixed_threshold else "moved by the link's use from now on"
        log.info("gateway ready: %s; t %d, rule %s: %s", ", ".join(self.workers), self.threshold, self.rule, moving)
        return self

    async def launch(self, w: WorkerHandle) -> None:
        """Start a worker, follow it, and put an emulated link in front of what crosses clusters into it:
        a decode worker's KV port (PrfaaS states) and, with cache moves, a prefill worker's."""
        try:
            reader = await reported(self.on_startup, w.name, f"{w.cluster} {w.role} worker", w.start())
            if w.role == "decode":
                self.link_ports[w.name] = await self._route_link(w.kv_port)
            elif self.config.cache.moves:
                emulator = EmulatorProcess(("127.0.0.1", w.kv_port), **self._link_options())
                entered = self._stack.enter_async_context(emulator)
                self.move_links[w.name] = await reported(
                    self.on_startup, f"{w.name}-link", "link emulator for cache moves", entered
                )
        except BaseException:
            await w.stop()
            raise
        if w.cluster == "prfaas" and w.role == "prefill":
            self.scheduler.calibrated(w.codecs)
        w.on_unclaimed = self._unclaimed
        self.prefixes.forget(w.name)  # a new pool starts empty
        self.known_names.add(w.name)
        self.workers[w.name] = w
        assert self._tasks is not None
        self._tasks.create_task(self._supervise(w, reader))
        self._tasks.create_task(self._follow_cache(w))

    def _unclaimed(self, w: WorkerHandle, msg: dict) -> None:
        if msg.get("op") == "aborted":  # a prefill the gateway aborted has stopped
            req, tokens, done = msg["req"], msg["tokens"], msg["done_tokens"]
            log.info("%s stopped the prefill of %s after %d of %d tokens", w.name, req, done, tokens)
            self.metrics.prefill_stopped(w.cluster, tokens, done)

    async def retire(self, w: WorkerHandle) -> None:
        """Stop a worker for good (it changes role: ``serve.roles``); forget its pool and its link."""
        w.retired = True
        self.workers.pop(w.name, None)
        await w.stop()
        port = self.link_ports.pop(w.name, None)
        if port is not None and self.link is not None:
            with contextlib.suppress(EmulatorError, OSError, TimeoutError):
                await self.link.control.remove_route(port)
        emulator = self.move_links.pop(w.name, None)
        if emulator is not None:
            await emulator.__aexit__(None, None, None)
        self.prefixes.drop(w.name)

    def _link_options(self) -> dict[str, object]:
        link = self.config.link
        return {
            "rate": link.rate,
            "flow_rate": link.flow_rate,
            "window": link.window,
            "delay_ms": link.delay_ms,
            "jitter_ms": link.jitter_ms,
        }

    async def _route_link(self, kv_port: int) -> int:
        """The inter-cluster link's port towards ``kv_port``: the link starts with the first decode worker."""
        async with self._link_lock:
            if self.link is None:
                emulator = EmulatorProcess(("127.0.0.1", kv_port), **self._link_options())
                entered = self._stack.enter_async_context(emulator)
                self.link = await reported(self.on_startup, LINK, f"link emulator, {self.config.link.rate}", entered)
                return self.link.port
            return await self.link.control.add_route(("127.0.0.1", kv_port))

    async def _watch_links(self, period: float = 1.0) -> None:
        """Sample the inter-cluster link and the stage queues into /metrics."""
        while not self._closing:
            try:
                stats = await self.link.control.stats() if self.link is not None else None
            except (OSError, RuntimeError, TimeoutError):
                stats = None
            if stats is not None:
                self.link_stats[LINK] = stats
                self.metrics.set_link_utilization(LINK, stats.get("utilisation") or 0.0)
            for stage, cluster, role in (("prfaas_prefill", "prfaas", "prefill"), ("pd_prefill", "pd", "prefill")):
                queued = sum(w.requests for w in self.workers.values() if w.cluster == cluster and w.role == role)
                self.metrics.set_queue_depth(stage, queued)
            self.metrics.set_queue_depth("decode", sum(w.requests for w in self._decode_workers()))
            if not self._closing:  # shutdown may have begun while the link answered: start no conversion now
                self.scheduler.tick(time.monotonic())
            await asyncio.sleep(period)

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    @property
    def closing(self) -> bool:
        return self._closing

    async def _shutdown(self) -> None:
        self._closing = True
        await self.roles.cancel()
        await asyncio.gather(*(w.stop() for w in self.workers.values()))
        for w in self.workers.values():
            if CACHE_EVENTS in w.inboxes:  # ends _follow_cache even if no process was left to lose
                w.inboxes[CACHE_EVENTS].put_nowait(LOST)

    async def _supervise(self, w: WorkerHandle, reader: asyncio.StreamReader) -> None:
        """Pump a worker's replies; when it dies, say so and start a new one in its place."""
        while True:
            await w.pump(reader)
            if self._closing or w.retired:
                return
            log.error("worker %s died (%s): restarting it", w.name, await w.exit_status())
            await w.stop()
            w.restarts += 1
            while not self._closing:
                try:
                    reader = await reported(self.on_startup, w.name, f"{w.cluster} {w.role} worker", w.start())
                    break
                except RuntimeError as e:
                    log.error("%s", e)
                    await asyncio.sleep(2.0)
            if self._closing:  # shutdown began meanwhile, after it stopped the workers it knew of
                await w.stop()
                return

    async def _follow_cache(self, w: WorkerHandle) -> None:
        """Keep the prefix directory current with the worker's pool, through restarts, until shutdown."""
        inbox = w.open(CACHE_EVENTS)
        while not self._closing:
            msg = await inbox.get()
            if msg["op"] == "cache":
                self.prefixes.apply(msg["events"])
            elif msg["op"] == "lost" and w.retired:
                self.prefixes.drop(w.name)
                return
            elif msg["op"] == "lost":
                self.prefixes.forget(w.name)  # its pool died with it; a restarted one starts empty

    def _decode_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.role == "decode"]

    def health(self) -> dict:
        status = {n: ("down" if not w.alive else "draining" if w.draining else "up") for n, w in self.workers.items()}
        healthy = any(w.alive for w in self._decode_workers()) and any(
            w.alive for w in self.workers.values() if w.role == "prefill"
        )
        return {
            "status": "ok" if healthy else "degraded",
            "healthy": healthy,
            "workers": status,
            "threshold": self.threshold,
            "inflight": self.inflight,
            "cache_moves": dict(self.cache_moves),
            "role_changes": dict(self.roles.counts),
        }

    def _route(self, prompt_ids: list[int], exclude: frozenset[str] = frozenset()) -> RouteDecision:
        hits = self.prefixes.node_hits(prompt_ids)

        def nodes(cluster: str, role: str) -> tuple[NodeView, ...]:
            return tuple(
                NodeView(w.name, hits.get(w.name, 0), w.load_tokens, w.serving and w.name not in exclude)
                for w in self.workers.values()
                if w.cluster == cluster and w.role == role
            )

        decision = self.router.route(
            RouteInput(
                len(prompt_ids),
                self.threshold,
                self.rule,
                ClusterView("prfaas", prefill_nodes=nodes("prfaas", "prefill")),
                ClusterView("pd", prefill_nodes=nodes("pd", "prefill"), decode_nodes=nodes("pd", "decode")),
            )
        )
        if decision.path is Path.REJECT:
            raise RequestFailed(f"no healthy worker can serve the request ({decision.reason})")
        self.scheduler.observe(decision)
        return decision

    async def stream(self, request: GenerateRequest, record: RequestRecord) -> AsyncIterator[TokenEvent]:
        if self.inflight >= self.config.max_queued_requests:
            raise Overloaded(f"{self.inflight} requests in flight; try again later")
        self.inflight += 1
        start = time.perf_counter()
        rid, decode = request.request_id, None
        c = self.config
        deadline = RequestDeadline(
            c.first_token_timeout, c.token_timeout, c.request_timeout, asyncio.get_running_loop().time()
        )
        try:
            async with deadline.first_token():
                decision = self._route(request.prompt_ids)
                decode = self.workers[decision.decode_node]  # type: ignore[index]
                record.decode_worker = decode.name
                inbox = decode.open(rid)
                transfer, first = await self.dispatch.run(request, record, decision, decode)
            record.ttft_s = time.perf_counter() - start
            record.phase = advance(record.phase, Phase.DECODING)
            tokens = decode_tokens(request, record, self.tokenizer, decode, inbox, transfer, first, deadline)
            async for event in tokens:
                yield event
            record.phase = advance(record.phase, Phase.FINISHED)
        except DeadlineExceeded:
            record.phase = Phase.FAILED
            raise
        finally:
            self.inflight -= 1
            record.e2e_s = time.perf_counter() - start
            self.scheduler.finished(record.completion_tokens)
            if decode is not None:
                decode.close(rid)
                if not record.phase.done:
                    record.phase = Phase.ABORTED
                with contextlib.suppress(RuntimeError):  # frees the row if a stop string or the client ended it
                    decode.send({"op": "abort", "req": rid})
