"""The gateway: one asyncio program that starts the clusters and runs every request through them.

Processes it owns (all children; none outlives it):
    PrfaaS cluster   prefill workers, remote: their KV crosses the emulated link
    PD cluster       PD-P prefill workers and PD-D decode workers, local
    link emulator    one relay in front of each decode worker's KV port

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
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator

from minifaas.model.loader import ModelSpec, load_config, load_config_dict
from minifaas.model.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDecoder, Tokenizer
from minifaas.policy.router import (
    CacheMove,
    ClusterView,
    NodeView,
    Path,
    RouteDecision,
    RouteInput,
    Router,
    RouterConfig,
    Rule,
)
from minifaas.scheduler.loop import LiveScheduler
from minifaas.scheduler.short_term import ShortTermConfig
from minifaas.serve.config import ServeConfig
from minifaas.serve.control import CACHE_EVENTS, sampling_to_json
from minifaas.serve.lifecycle import Phase, advance
from minifaas.serve.metrics import ServeMetrics
from minifaas.serve.prefix_directory import PrefixDirectory
from minifaas.serve.prefix_store import needs_snapshot, state_layout
from minifaas.serve.requests import GenerateRequest, Overloaded, RequestFailed, RequestRecord, TokenEvent
from minifaas.serve.worker_handle import LOST, WorkerHandle
from minifaas.transport.emulator_control import EmulatorProcess

log = logging.getLogger("minifaas.gateway")


class Gateway:
    def __init__(self, config: ServeConfig, metrics: ServeMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or ServeMetrics()
        self.link_stats: dict[str, dict] = {}
        spec = ModelSpec.resolve(config.model, config.seed)
        self.model_name = spec.name
        self.tokenizer: Tokenizer = ByteTokenizer() if spec.kind == "preset" else HFTokenizer(spec.path.parent)
        self.max_context = int(load_config_dict(spec).get("max_position_embeddings", 32768))
        self.threshold = config.threshold
        self.rule = Rule(config.cache.rule)
        # the gateway works out the incremental transfer itself, per decode node (see _prefill_once)
        self.router = Router(RouterConfig(cross_cluster_cache_move=config.cache.moves, incremental_transfer=False))
        self.secret = secrets.token_bytes(32)
        self.workers = self._plan_workers()
        hybrid = needs_snapshot(state_layout(load_config(spec)))
        self.prefixes = PrefixDirectory(config.cache, spec.name, hybrid, self.workers)
        self.emulators: dict[str, EmulatorProcess] = {}
        self.move_links: dict[str, EmulatorProcess] = {}  # the link into each prefill node, for cache moves
        self.cache_moves: Counter[str] = Counter()
        short_term = ShortTermConfig(enabled=not config.fixed_threshold, ceiling=self.max_context)
        self.scheduler = LiveScheduler(self, short_term)
        self.inflight = 0
        self.fallbacks: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self._stack = contextlib.AsyncExitStack()
        self._tasks: asyncio.TaskGroup | None = None

    def _plan_workers(self) -> dict[str, WorkerHandle]:
        c = self.config
        common = ["--model", c.model, "--seed", str(c.seed), "--connections", str(c.link.connections)]
        if not c.link.pipelined:
            common.append("--no-pipelining")
        plan = [
            ("prfaas-p", "prefill", "prfaas", c.prfaas.prefill_workers, c.prfaas.device),
            ("pd-p", "prefill", "pd", c.pd.prefill_workers, c.pd.device),
            ("pd-d", "decode", "pd", c.pd.decode_workers, c.pd.device),
        ]
        cache = [
            *("--cache-block-size", str(c.cache.block_size), "--cache-mib", str(c.cache.capacity_mib)),
            *("--snapshot-interval", str(c.cache.snapshot_interval_blocks)),
        ]
        keep_received = c.cache.enabled and c.cache.incremental_transfer
        workers = {}
        for prefix, role, cluster, count, device in plan:
            for i in range(count):
                argv = [*common, "--device", device]
                if role == "prefill":
                    argv += [*cache, "--prefix-cache", c.cache.mode]
                    if c.cache.moves:
                        argv += ["--accept-moves", "--kv-port", str(_free_port())]
                else:  # a decode node keeps the KV it receives only to take increments later
                    argv += [*cache, "--prefix-cache", "hybrid" if keep_received else "none"]
                if role == "decode":  # a fixed port, so a restarted worker is found where the emulator points
                    argv += ["--kv-port", str(_free_port()), "--max-batch", str(c.pd.max_batch)]
                workers[f"{prefix}{i}"] = WorkerHandle(f"{prefix}{i}", role, cluster, argv, self.secret)
        return workers

    async def __aenter__(self) -> Gateway:
        self._tasks = await self._stack.enter_async_context(asyncio.TaskGroup())
        self._stack.push_async_callback(self._shutdown)
        try:
            readers = await asyncio.gather(*(w.start() for w in self.workers.values()))
            for w, reader in zip(self.workers.values(), readers):
                self._tasks.create_task(self._supervise(w, reader))
                self._tasks.create_task(self._follow_cache(w))
            link = self.config.link
            options = {"rate": link.rate, "flow_rate": link.flow_rate, "delay_ms": link.delay_ms}
            options["jitter_ms"] = link.jitter_ms
            for w in self._decode_workers():
                emulator = EmulatorProcess(("127.0.0.1", w.kv_port), **options)
                self.emulators[w.name] = await self._stack.enter_async_context(emulator)
            if self.config.cache.moves:  # not sampled by _watch_links: the scheduler watches PrfaaS egress
                for w in self.workers.values():
                    if w.role == "prefill":
                        emulator = EmulatorProcess(("127.0.0.1", w.kv_port), **options)
                        self.move_links[w.name] = await self._stack.enter_async_context(emulator)
        except BaseException:
            await self._stack.aclose()
            raise
        self._tasks.create_task(self._watch_links())
        log.info("gateway ready: %s", ", ".join(self.workers))
        return self

    async def _watch_links(self, period: float = 1.0) -> None:
        """Sample each emulated link and the stage queues into /metrics."""
        while not self._closing:
            for name, emulator in self.emulators.items():
                try:
                    stats = await emulator.control.stats()
                except (OSError, RuntimeError, TimeoutError):
                    continue
                self.link_stats[name] = stats
                self.metrics.set_link_utilization(f"prfaas->{name}", stats.get("utilisation") or 0.0)
            for stage, cluster, role in (("prfaas_prefill", "prfaas", "prefill"), ("pd_prefill", "pd", "prefill")):
                queued = sum(len(w.inboxes) for w in self.workers.values() if w.cluster == cluster and w.role == role)
                self.metrics.set_queue_depth(stage, queued)
            self.metrics.set_queue_depth("decode", sum(len(w.inboxes) for w in self._decode_workers()))
            self.scheduler.tick(time.monotonic())
            await asyncio.sleep(period)

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _shutdown(self) -> None:
        self._closing = True
        await asyncio.gather(*(w.stop() for w in self.workers.values()))
        for w in self.workers.values():
            if CACHE_EVENTS in w.inboxes:  # ends _follow_cache even if no process was left to lose
                w.inboxes[CACHE_EVENTS].put_nowait(LOST)

    async def _supervise(self, w: WorkerHandle, reader: asyncio.StreamReader) -> None:
        """Pump a worker's replies; when it dies, say so and start a new one in its place."""
        while True:
            await w.pump(reader)
            if self._closing:
                return
            code = w.process.returncode if w.process else None
            log.error("worker %s died (exit code %s): restarting it", w.name, code)
            await w.stop()
            w.restarts += 1
            while not self._closing:
                try:
                    reader = await w.start()
                    break
                except RuntimeError as e:
                    log.error("%s", e)
                    await asyncio.sleep(2.0)
            else:
                return

    async def _follow_cache(self, w: WorkerHandle) -> None:
        """Keep the prefix directory current with the worker's pool, through restarts, until shutdown."""
        inbox = w.open(CACHE_EVENTS)
        while not self._closing:
            msg = await inbox.get()
            if msg["op"] == "cache":
                self.prefixes.apply(msg["events"])
            elif msg["op"] == "lost":
                self.prefixes.forget(w.name)  # its pool died with it; a restarted one starts empty

    def _decode_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.role == "decode"]

    def health(self) -> dict:
        status = {name: ("up" if w.alive else "down") for name, w in self.workers.items()}
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
        }

    def _route(self, prompt_ids: list[int], exclude: frozenset[str] = frozenset()) -> RouteDecision:
        hits = self.prefixes.node_hits(prompt_ids)

        def nodes(cluster: str, role: str) -> tuple[NodeView, ...]:
            return tuple(
                NodeView(w.name, hits.get(w.name, 0), w.load_tokens, w.alive and w.name not in exclude)
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
        try:
            async with asyncio.timeout(self.config.request_timeout):
                decision = self._route(request.prompt_ids)
                decode = self.workers[decision.decode_node]  # type: ignore[index]
                record.decode_worker = decode.name
                inbox = decode.open(rid)
                transfer, first = await self._prefill(request, record, decision, decode)
                record.ttft_s = time.perf_counter() - start
                record.phase = advance(record.phase, Phase.DECODING)
                async for event in self._decode(request, record, decode, inbox, transfer, first):
                    yield event
                record.phase = advance(record.phase, Phase.FINISHED)
        except TimeoutError:
            record.phase = Phase.FAILED
            raise RequestFailed(f"no answer within {self.config.request_timeout:.0f} s") from None
        finally:
            self.inflight -= 1
            record.e2e_s = time.perf_counter() - start
            if decode is not None:
                decode.close(rid)
                if record.phase is not Phase.FINISHED:
                    if not record.phase.done:
                        record.phase = Phase.ABORTED
                    with contextlib.suppress(RuntimeError):
                        decode.send({"op": "abort", "req": rid})

    async def _prefill(
        self, request: GenerateRequest, record: RequestRecord, decision: RouteDecision, decode: WorkerHandle
    ) -> tuple[int, int]:
        """Prefill on the routed worker; if that fails, on a PD-P worker. Returns (transfer id, first token)."""
        tried: set[str] = set()
        worker = self.workers[decision.prefill_node]  # type: ignore[index]
        expected_hit = decision.cached_tokens
        moved = await self._move(request, record, decision.cache_move, worker) if decision.cache_move else None
        while True:
            record.route = "prfaas" if worker.cluster == "prfaas" else "local"
            record.prefill_worker = worker.name
            record.phase = advance(record.phase, Phase.PREFILLING)
            transfer = next(self._ids)
            port = self.emulators[decode.name].port if worker.cluster == "prfaas" else decode.kv_port
            outcome = await self._prefill_once(request, record, worker, decode, transfer, port, expected_hit, moved)
            moved = None  # a retry elsewhere does not take the move
            if isinstance(outcome, int):
                return transfer, outcome
            tried.add(worker.name)
            log.warning("request %s: prefill on %s failed (%s)", request.request_id, worker.name, outcome)
            record.phase = advance(record.phase, Phase.FALLBACK)
            reason = outcome.split(":")[0]
            record.fallback = reason
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
            with contextlib.suppress(RuntimeError):
                decode.send({"op": "abort", "req": request.request_id})
            local = [
                w
                for w in self.workers.values()
                if w.role == "prefill" and w.cluster == "pd" and w.alive and w.name not in tried
            ]
            if not local:
                raise RequestFailed(f"prefill failed on every worker tried: {outcome}")
            hits = self.prefixes.node_hits(request.prompt_ids)
            worker = min(local, key=lambda w: w.load_tokens - hits.get(w.name, 0))
            expected_hit = hits.get(worker.name, 0)

    async def _prefill_once(
        self,
        request: GenerateRequest,
        record: RequestRecord,
        worker: WorkerHandle,
        decode: WorkerHandle,
        transfer: int,
        port: int,
        expected_hit: int,
        moved: int | None = None,
    ) -> int | str:
        """The first token, or why this attempt failed."""
        rid, n = request.request_id, len(request.prompt_ids) - expected_hit  # the tokens it will compute
        sampling = sampling_to_json(request.sampling)
        inbox = worker.open(rid)
        worker.load_tokens += n
        # only the inter-cluster link is worth a round trip to the decode node to pin its prefix first
        link_start = self.prefixes.kv_prefix(request.prompt_ids, decode.name) if worker.cluster == "prfaas" else 0
        try:
            decode.send(
                {
                    "op": "decode",
                    "req": rid,
                    "transfer": transfer,
                    "sampling": sampling,
                    "tokens": request.prompt_ids,
                    "link_start": link_start,
                }
            )
            if link_start:
                link_start = await self._pinned(decode, rid, transfer)
            worker.send(
                {
                    "op": "prefill",
                    "req": rid,
                    "transfer": transfer,
                    "tokens": request.prompt_ids,
                    "sampling": sampling,
                    "kv": ["127.0.0.1", port],
                    "link_start": link_start,
                    **({"import": moved} if moved is not None else {}),
                }
            )
            async with asyncio.timeout(self.config.prefill_timeout):
                reply = await inbox.get()
        except TimeoutError:
            return "timeout: prefill and transfer took too long"
        except RuntimeError as e:
            return f"worker_down: {e}"
        finally:
            worker.load_tokens -= n
            worker.close(rid)
        if reply["op"] == "lost":
            return f"worker_lost: {worker.name} went away"
        if reply["op"] == "failed":
            return f"transfer_failed: {reply['error']}"
        record.kv_bytes = reply["kv_bytes"]
        record.cached_tokens = reply["cached_tokens"]
        self.metrics.add_kv_bytes(f"{worker.cluster}->{decode.name}", reply["kv_bytes"])
        record.queue_s = reply["queue_s"]
        record.transfer_s = reply["transfer_tail_s"]
        record.phase = advance(record.phase, Phase.TRANSFERRING)
        return int(reply["next_token"])

    async def _move(
        self, request: GenerateRequest, record: RequestRecord, move: CacheMove, dst: WorkerHandle
    ) -> int | None:
        """Carry out the router's cache move: the source cluster's node with the longest hit sends that
        prefix's state to ``dst`` across the link. Returns the transfer ``dst`` takes it from, or None."""
        rid, transfer = request.request_id, next(self._ids)
        hits = self.prefixes.node_hits(request.prompt_ids)
        sources = [w for w in self.workers.values() if w.cluster == move.src and w.alive and hits.get(w.name, 0)]
        if not sources or dst.name not in self.move_links:
            self.cache_moves["no_source"] += 1
            return None
        src = max(sources, key=lambda w: (hits[w.name], w.name))
        inbox = src.open(rid)
        try:
            link = ["127.0.0.1", self.move_links[dst.name].port]
            tokens, length = request.prompt_ids, move.end_tokens
            src.send({"op": "export", "req": rid, "transfer": transfer, "tokens": tokens, "length": length, "kv": link})
            async with asyncio.timeout(self.config.prefill_timeout):
                reply = await inbox.get()
        except (TimeoutError, RuntimeError) as e:
            reply = {"op": "failed", "error": repr(e)}
        finally:
            src.close(rid)
        if reply["op"] != "exported" or not reply["tokens"]:
            log.warning("request %s: cache move %s -> %s failed: %s", rid, src.name, dst.name, reply.get("error"))
            self.cache_moves["failed"] += 1
            return None
        self.cache_moves["done"] += 1
        self.cache_moves["bytes"] += reply["bytes"]
        self.metrics.add_kv_bytes(f"{src.name}->{dst.name}", reply["bytes"])
        record.events.append(f"cache_move {src.name}->{dst.name} {reply['tokens']} tokens")
        return transfer

    async def _pinned(self, decode: WorkerHandle, rid: str, transfer: int) -> int:
        """Tokens of the prompt whose KV the decode node has pinned: the prefill sends only the rest."""
        inbox = decode.inboxes[rid]
        async with asyncio.timeout(self.config.prefill_timeout):
            while True:
                msg = await inbox.get()
                if msg["op"] == "lost" or (msg["op"] == "failed" and msg.get("transfer") == transfer):
                    raise RuntimeError(f"decode worker {decode.name}: {msg.get('error', 'went away')}")
                if msg["op"] == "pinned" and msg["transfer"] == transfer:
                    return int(msg["tokens"])

    async def _decode(
        self,
        request: GenerateRequest,
        record: RequestRecord,
        decode: WorkerHandle,
        inbox: asyncio.Queue[dict],
        transfer: int,
        first: int,
    ) -> AsyncIterator[TokenEvent]:
        detok = IncrementalDecoder(self.tokenizer)
        stops, text = request.sampling.stop, ""
        token, finish = first, _finish_of(first, 1, request, self.tokenizer)
        if finish is None:
            decode.send({"op": "start", "req": request.request_id, "next_token": first})
        while True:
            record.completion_tokens += 1
            piece = detok.push(token)
            if stops and piece:
                cut = _find_stop(text, piece, stops)
                if cut is not None:
                    yield TokenEvent(token, piece[:cut], "stop")
                    return
            text += piece
            yield TokenEvent(token, piece, finish)
            if finish is not None:
                return
            msg = await inbox.get()
            while msg.get("transfer", transfer) != transfer or msg["op"] in ("received", "pinned"):
                msg = await inbox.get()  # "received", or news of an abandoned transfer
            if msg["op"] in ("lost", "failed"):
                raise RequestFailed(f"decode worker {decode.name}: {msg.get('error', 'went away')}")
            if msg["op"] == "done":
                return
            if msg["op"] == "token":
                token, finish = msg["token"], msg["finish"]


def _finish_of(token: int, count: int, request: GenerateRequest, tokenizer: Tokenizer) -> str | None:
    p = request.sampling
    if (token == tokenizer.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
        return "stop"
    return "length" if count >= p.max_tokens else None


def _find_stop(text: str, piece: str, stops: tuple[str, ...]) -> int | None:
    """Where in ``piece`` the output must end, if ``text + piece`` now contains a stop string."""
    combined = text + piece
    window_start = max(0, len(text) - max(len(s) for s in stops) + 1)
    hits = [i for s in stops if (i := combined.find(s, window_start)) != -1]
    return max(min(hits) - len(text), 0) if hits else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
