"""The cluster simulator: a workload replayed through the live router, prefix caches and cost profiles.

A request's life is a chain of events: arrive (cache hits, the router, a prefill and a decode node), its
forward's start (a PrfaaS prefill's KV starts streaming) and end, link (its KV has crossed), kv_ready (it joins
a decode batch or waits for a slot) and decode_end. On a shared host (``SimConfig.shared_cores``) every change in
the workers computing re-times what each has left, as the host's cores are shared among them (``_share_cores``).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable

import numpy as np

from minifaas.cache.prefix_index import PromptKeys
from minifaas.policy.codec_policy import TransferShape
from minifaas.policy.interfaces import RoutingPolicy
from minifaas.policy.plugin import ROUTER, building, load_policy
from minifaas.policy.router import ClusterView, Path, RouteInput, Router
from minifaas.sim.coding import SimCoding
from minifaas.sim.decode import BatchClock, DecodeInstances
from minifaas.sim.deployment import SimConfig
from minifaas.sim.engine import EventLoop
from minifaas.sim.fluid_link import FluidLink
from minifaas.sim.prefill import Forward, PrefillInstances
from minifaas.sim.prefix import ClusterPrefixCaches, cluster_view
from minifaas.sim.report import SimResult, mean, percentile
from minifaas.sim.scheduling import SimScheduler
from minifaas.sim.workload import Workload

PD, PRFAAS, REJECTED = 0, 1, 2


class Simulation:
    def __init__(self, config: SimConfig, workload: Workload) -> None:
        self.config = config
        self.workload = workload
        self.loop = EventLoop()
        with building(ROUTER, config.router_policy):
            self.router: RoutingPolicy = (
                Router(**{"config": config.router, **dict(config.router_args)}) if config.router_policy == "default"
                else load_policy(config.router_policy, ROUTER, config.router_args, config=config.router)
            )  # fmt: skip
        self.prompt_tokens = self.cached_tokens = 0  # of the requests routed: the prefix hit ratio
        batch, turnaround = config.prefill_batch_tokens, config.prefill_turnaround_s
        self.prfaas = PrefillInstances("prfaas", "prfaas", config.prfaas, config.n_prfaas, batch, turnaround)
        self.pd = PrefillInstances("pd", "pd-p", config.pd_prefill, config.n_prefill, batch, turnaround)
        self.decode = DecodeInstances(
            config.decode, config.n_decode, config.decode_step_by_batch, config.decode_hold, config.decode_hold_max_s
        )
        self.link = FluidLink(config.link.gbps)
        self.caches: ClusterPrefixCaches | None = None
        if config.prefix_cache and workload.hash_ids is not None:
            self.caches = ClusterPrefixCaches(
                (self.prfaas.cluster, self.pd.cluster), workload.block_tokens, config.cache_bytes, config.prfaas,
                config.snapshot_interval_blocks, config.snapshot_policy, config.snapshot_args,
            )  # fmt: skip
        n = len(workload)
        self._arrival = workload.arrival_s.tolist()
        self._prompt = workload.input_tokens.tolist()
        self._output = workload.output_tokens.tolist()
        self.path = [REJECTED] * n
        self.prefill_node = [0] * n  # index in the pool its path names
        self._tokens = [0] * n  # incremental (computed) prefill tokens
        self.decode_node = [0] * n  # index in the decode instances
        self._prefill_end = [math.nan] * n  # when its prefill ended
        self._forward: list[Forward | None] = [None] * n  # the forward it rides in, until it ends
        self._kv_after: dict[int, float] = {}  # PrfaaS: its KV's time after its prefill ends, once it has crossed
        self._kv_early: dict[int, float] = {}  # ... for those whose KV crossed before their prefill ended
        self._shared = bool(config.shared_cores)
        self._step_slowdown = 1.0  # on a shared host: the decode clocks' slowdown
        self._kv_bytes = [0.0] * n  # on the wire
        self._link_committed = 0.0  # wire bytes routed across the link and not yet across, as the gateway counts them
        self._coding_s = [0.0] * n
        self.coding = SimCoding(config.kv_compression, config.codecs, config.kv_compression_args)
        self._keys: dict[int, list] = {}  # rid -> [block keys, uses left, branch point]: dropped after the last use
        self.first_token = [math.nan] * n
        self.finished = [math.nan] * n
        self._link_gen = 0
        self._step = config.decode.step_time_s
        self._by_batch = config.decode_step_by_batch
        self._delivery = config.delivery_s
        self._early = config.early_first_token
        self._whole_hits = config.whole_prompt_hits
        self._samples: list[tuple[float, int, int, int, int, int]] = []
        self.scheduler = SimScheduler(config, workload, self.loop, self.link, self.prfaas, self.pd, self.decode)

    # ---- running -------------------------------------------------------------------------
    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        loop = self.loop
        loop.feed(self._arrival, self._arrive)
        for at_s, gbps in self.config.link.schedule:
            loop.at(at_s, self._set_bandwidth, gbps)
        loop.at(0.0, self._sample)
        until = math.inf if self.config.drain else self.workload.duration_s
        # The run makes many small objects and no reference cycles: the cyclic collector would only walk them
        # again and again, though they die by reference counts.
        collecting = gc.isenabled()
        gc.disable()
        try:
            loop.run(until=until, tick=progress)
            return self._result()
        finally:
            if collecting:
                gc.enable()

    def _arrive(self, rid: int) -> None:
        now = self.loop.now
        prompt = self._prompt[rid]
        prfaas_nodes, pd_nodes, decode_nodes = self.prfaas.views({}), self.pd.views({}), self.decode.views()
        if self.caches is None:
            prfaas = ClusterView(self.prfaas.cluster, prfaas_nodes)
            pd = ClusterView(self.pd.cluster, pd_nodes, decode_nodes)
        else:  # as the gateway does: the global manager's match, turned into the router's view
            keys = self.caches.keys(self.workload.hash_ids[rid], prompt)  # type: ignore[index]
            matches = self.caches.match(keys)
            prfaas = cluster_view(matches[self.prfaas.cluster], prfaas_nodes)
            pd = cluster_view(matches[self.pd.cluster], pd_nodes, decode_nodes)
        sched = self.scheduler
        committed, rate = self._link_committed, self.link.bytes_per_s
        backlog = 0.0 if committed <= 0 else committed / rate if rate > 0 else math.inf  # <= 0: float error
        req = RouteInput(prompt, sched.threshold, sched.rule, prfaas, pd, link_utilisation=sched.utilisation,
                         link_backlog_s=backlog)  # fmt: skip
        decision = self.router.route(req)
        if decision.path is Path.REJECT:
            return
        pool = self.prfaas if decision.path is Path.PRFAAS else self.pd
        tokens, cached = decision.incremental_tokens, decision.cached_tokens
        if self._whole_hits and self.caches is not None and self.caches.holds_whole(pool.cluster, keys):
            tokens, cached = 0, prompt  # the first token from the logits kept with the prompt's end snapshot
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        if self.caches is not None:  # stored after prefill, and a PrfaaS prompt's KV again where it lands
            seen = max(m.kv_prefix_tokens for m in matches.values())  # the branch point, as the gateway sends it
            self._keys[rid] = [keys, 2 if decision.path is Path.PRFAAS else 1, seen]
        sched.lengths.append(tokens)
        node = pool.index[decision.prefill_node]  # type: ignore[index]
        cold = not cached and tokens == prompt
        forward = pool.place(node, now, tokens, rid, cold)
        start, end = forward.start, forward.end
        dnode = self.decode.index[decision.decode_node]  # type: ignore[index]
        self.decode.reserve(dnode)
        if self._by_batch and self.config.decode_hold:  # one more on its way: the instance may hold its steps now
            self._schedule_leave(dnode)
        self.prefill_node[rid], self.decode_node[rid] = node, dnode
        self._tokens[rid], self._forward[rid] = tokens, forward
        move = decision.cache_move
        if move is not None and move.src == self.prfaas.cluster:
            # A PrfaaS prefix moved to PD shares the egress pipe. The prefill is not held back
            # for it (optimistic), and PD -> PrfaaS moves use the other direction, not modelled.
            self.link.add(now, -1 - rid, pool.kv_bytes(move.end_tokens - move.start_tokens))
            self._reschedule_link()
        if decision.path is Path.PRFAAS:
            self.path[rid] = PRFAAS
            shipped = prompt - decision.link_kv_start
            nbytes, layers = pool.kv_bytes(shipped), self.config.link.pipeline_layers
            shape = TransferShape(nbytes, end - start if layers else 0.0, nbytes / layers if layers else nbytes)
            self._kv_bytes[rid], self._coding_s[rid] = self.coding.transfer(
                shape, self.link.bytes_per_s * 8, sched.utilisation, self.link.active
            )
            self._link_committed += self._kv_bytes[rid]
        else:
            self.path[rid] = PD
        self._schedule_forward(pool, node, forward)
        if self._shared:
            self._share_cores()

    def _schedule_forward(self, pool: PrefillInstances, node: int, forward: Forward) -> None:
        """Events at the forward's start (a PrfaaS forward's KV starts streaming) and end, for its ``version``."""
        event = (pool, node, forward, forward.version)
        if not forward.started and pool is self.prfaas and self.config.link.pipeline_layers:
            self.loop.at(max(forward.start, self.loop.now), self._forward_start, event)
        self.loop.at(max(forward.end, self.loop.now), self._forward_end, event)

    def _share_cores(self) -> None:
        """On a shared host, after any change in the workers computing: each computes what it has left at the
        slowdown for the workers computing now (prefill nodes ``rescale``, decode clocks ``restep``)."""
        prefill, step = self._slowdowns()
        for pool in (self.prfaas, self.pd):
            for node in range(len(pool)):
                for forward in pool.rescale(node, self.loop.now, prefill):  # none where the speed is the same
                    self._schedule_forward(pool, node, forward)
        if self._by_batch and step != self._step_slowdown:
            for node, rows in enumerate(self.decode.running):
                if rows:
                    self._schedule_leave(node)
        self._step_slowdown = step

    def _slowdowns(self) -> tuple[float, float]:
        """A prefill's and a decode step's time over the profile's with the workers computing now
        (``SimConfig.slowdown``; for a prefill beside a decoding batch alone, ``beside_decode`` by the share of
        its steps the batch computes)."""
        c = self.config
        if not c.shared_cores:
            return 1.0, 1.0
        prefilling = self.prfaas.busy() + self.pd.busy()
        decoding = self.decode.computing()
        step = c.slowdown(prefilling + decoding)
        if c.beside_decode and prefilling == 1 and 0 < decoding <= 1:
            return 1.0 + (c.beside_decode - 1.0) * decoding, step
        return step, step

    def _forward_start(self, event: tuple[PrefillInstances, int, Forward, int]) -> None:
        _, _, forward, version = event
        if version != forward.version or forward.started:
            return  # it moved: a later event says when
        forward.started = True
        for rid in forward.requests:
            self.link.add(self.loop.now, rid, self._kv_bytes[rid])
        self._reschedule_link()

    def _forward_end(self, event: tuple[PrefillInstances, int, Forward, int]) -> None:
        pool, node, forward, version = event
        if version != forward.version:
            return  # it moved: a later event says when
        pool.ended(node)
        for rid in forward.requests:
            self._prefill_done(pool, rid)
        if self._shared:
            self._share_cores()

    def _prefill_done(self, pool: PrefillInstances, rid: int) -> None:
        now = self.loop.now
        self._prefill_end[rid], self._forward[rid] = now, None
        if pool.done(self.prefill_node[rid], self._tokens[rid]):
            self.scheduler.drained(into_prefill=False)
        if self._early:
            self.first_token[rid] = now + self._delivery
        if self.caches is not None:
            seen = self._keys[rid][2]
            self.caches.store(pool.cluster, self._used_keys(rid), now, seen)
        if self.path[rid] == PD:
            self._kv_ready(rid)
        elif not self.config.link.pipeline_layers:
            self.link.add(now, rid, self._kv_bytes[rid])
            self._reschedule_link()
        elif rid in self._kv_early:  # its KV crossed before this prefill, slowed since, ended
            self.loop.at(now + self._kv_early.pop(rid), self._kv_ready, rid)

    def _used_keys(self, rid: int) -> PromptKeys:
        held = self._keys[rid]
        held[1] -= 1
        if not held[1]:
            del self._keys[rid]
        return held[0]

    def _reschedule_link(self) -> None:
        self._link_gen += 1
        when = self.link.next_completion()
        if when < math.inf:
            self.loop.at(max(when, self.loop.now), self._link_event, self._link_gen)

    def _link_event(self, generation: int) -> None:
        if generation != self._link_gen:
            return  # superseded by a later add or bandwidth change
        now = self.loop.now
        layers = self.config.link.pipeline_layers
        for rid in self.link.pop_done(now):
            if rid < 0:
                continue  # a cache move: nothing waits for it here
            self._link_committed -= self._kv_bytes[rid]
            delay = self.config.link.one_way_s + self._coding_s[rid]
            ready, after = now + delay, delay  # after: its time past its prefill's end, should that end move
            if layers:  # the last layer leaves only after prefill ends
                tail = self._kv_bytes[rid] / layers / self.link.share_bytes_per_s()
                ended = self._prefill_end[rid]
                if math.isnan(ended):  # not yet: when it is expected to
                    ended = self._forward[rid].end  # type: ignore[union-attr]
                ready = max(now, ended + tail) + delay
                after += tail
            if self.caches is not None:
                self.caches.store_received(self.pd.cluster, self._used_keys(rid), ready)
            if self._shared:  # its prefill may yet slow
                self._kv_after[rid] = after
            self.loop.at(ready, self._kv_ready, rid)
        self._reschedule_link()

    def _set_bandwidth(self, gbps: float) -> None:
        self.link.set_bandwidth(self.loop.now, gbps)
        self._reschedule_link()

    def _kv_ready(self, rid: int) -> None:
        if self._shared:
            after = self._kv_after.pop(rid, 0.0)
            if math.isnan(self._prefill_end[rid]):  # its prefill slowed since the KV crossed: it ends first
                self._kv_early[rid] = after
                return
        if self.decode.arrive(self.decode_node[rid], rid):
            self._start_decode(rid)
            if self._shared:
                self._share_cores()

    def _start_decode(self, rid: int) -> None:
        now = self.loop.now
        steps = self._output[rid]
        if self._early:  # the prefill made the first token
            steps -= 1
        if self._by_batch:
            node = self.decode_node[rid]
            self.decode.join(node, rid, steps, now, self._prompt[rid])
            clock = self._schedule_leave(node)
            if not self._early:
                self.first_token[rid] = now + clock.step_s + self._delivery
            return
        if not self._early:
            self.first_token[rid] = now + self._step + self._delivery
        self.loop.at(now + steps * self._step, self._decode_end, rid)

    def _schedule_leave(self, node: int) -> BatchClock:
        """The event of the next request to leave the instance, at its clock's step now; earlier ones go stale."""
        rows = self.decode.running[node]  # none: no step to slow, and no workers counted for one
        clock = self.decode.restep(node, self._slowdowns()[1] if rows else 1.0)
        if clock.leaving:
            clock.generation += 1
            self.loop.at(max(clock.due(), self.loop.now), self._batch_leave, (node, clock.generation))
        return clock

    def _batch_leave(self, event: tuple[int, int]) -> None:
        node, generation = event
        if generation != self.decode.clocks[node].generation:
            return  # the rows changed since: a later event says when
        self._decode_end(self.decode.leave(node, self.loop.now))
        self._schedule_leave(node)

    def _decode_end(self, rid: int) -> None:
        self.finished[rid] = self.loop.now + self._delivery
        successor = self.decode.finish(self.decode_node[rid])
        if successor is not None:
            self._start_decode(successor)
        self.scheduler.decode_finished(self.decode_node[rid])
        if self._shared:
            self._share_cores()

    def _sample(self, _: object) -> None:
        self.scheduler.tick()
        d, now = self.decode, self.loop.now
        queues = (self.prfaas.in_system, self.pd.in_system, self.link.active, d.total_waiting, d.total_running)
        self._samples.append((now, *queues))
        # past the arrivals, with no event left to come (a link cut for good), the busy can never finish: stop
        if now < self.workload.duration_s or (sum(queues) and len(self.loop)):
            self.loop.at(now + self.config.sample_s, self._sample)

    # ---- results -------------------------------------------------------------------------
    def _result(self) -> SimResult:
        cfg, wl = self.config, self.workload
        start, end = cfg.warmup_s, wl.duration_s
        window = max(end - start, 1e-9)
        arrival = wl.arrival_s
        path, first, finished = np.array(self.path), np.array(self.first_token), np.array(self.finished)
        counted = (arrival >= start) & ~np.isnan(first)
        ttft = first[counted] - arrival[counted]
        routed = path != REJECTED
        self.link.advance(self.loop.now)
        bins = self.link.egress_gbps(end)[int(start // self.link.bins_s) :]
        makespan = max(self.loop.now, 1e-9)
        sched = self.scheduler
        trace = np.array(sched.trace, dtype=float).reshape(-1, 4)
        thresholds = trace[:, 1] if len(trace) else np.array([sched.threshold])
        return SimResult(
            requests=len(wl),
            completed=int(np.count_nonzero(~np.isnan(finished))),
            rejected=int(np.count_nonzero(~routed)),
            window_s=window,
            throughput_rps=float(np.count_nonzero((finished >= start) & (finished <= end)) / window),
            ttft_mean_s=mean(ttft),
            ttft_p50_s=percentile(ttft, 50),
            ttft_p90_s=percentile(ttft, 90),
            ttft_p99_s=percentile(ttft, 99),
            ttft_prfaas_mean_s=mean(first[counted & (path == PRFAAS)] - arrival[counted & (path == PRFAAS)]),
            ttft_pd_mean_s=mean(first[counted & (path == PD)] - arrival[counted & (path == PD)]),
            tpot_s=self._step,
            offload_fraction=float(np.count_nonzero(path == PRFAAS) / max(1, np.count_nonzero(routed))),
            prefix_hit_token_ratio=self.cached_tokens / max(1, self.prompt_tokens),
            egress_gbps_mean=mean(bins),
            egress_gbps_p99=percentile(bins, 99),
            link_utilisation=float(self.link.delivered.sum() / max(self.link.capacity_bytes, 1e-9)),
            prfaas_prefill_utilisation=self.prfaas.busy_by(makespan) / max(1e-9, makespan * len(self.prfaas)),
            pd_prefill_utilisation=self.pd.busy_by(makespan) / max(1e-9, makespan * len(self.pd)),
            events=self.loop.events,
            queues=np.array(self._samples, dtype=float).reshape(-1, 6),
            kv_coded_fraction=self.coding.coded_fraction,
            kv_wire_ratio=self.coding.ratio,
            threshold_final=int(sched.threshold),
            threshold_max=int(thresholds.max()),
            threshold_changes=int(np.count_nonzero(np.diff(thresholds))),
            role_conversions=sched.conversions,
            n_prefill_final=self.pd.serving,
            n_decode_final=self.decode.serving,
            schedule=trace,
        )
