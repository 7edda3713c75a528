"""Changing a PD worker's role while the gateway serves: planned on the scheduler's ticks; drain, restart, rejoin.

``RoleChanger`` plans the split with the long-term policy (``replan``) and carries it out on live processes, one
worker at a time: it picks the least busy worker of the shrinking role, drains it (abandoning the change past
``drain_timeout``), retires it, and starts a worker of the other role under a fresh name. PrfaaS and hand-started
workers are never re-roled.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from minifaas.config import NAME_PREFIX, ServeConfig
from minifaas.emulator.pacer import parse_rate
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.worker_handle import WorkerHandle
from minifaas.gateway.workers import STAGES, Workers
from minifaas.launch.worker_specs import worker_spec
from minifaas.planner.case import PlanCase
from minifaas.planner.lengths import LengthDistribution
from minifaas.planner.profile import DecodeProfile, PrefillProfile, load_pd_profiles, load_prefill_profile
from minifaas.policy.interfaces import LongTermControl, ShortTermControl
from minifaas.policy.long_term import LongTermConfig, LongTermPolicy
from minifaas.policy.plugin import LONG_TERM, building, load_policy
from minifaas.policy.signals import Signals

log = logging.getLogger("minifaas.gateway")
plan_log = logging.getLogger("minifaas.policy")  # the long-term planning's word, as the scheduler's
RETRY_S = 2.0  # between attempts to start a converted worker
UNLIMITED_LINK_GBPS = 1000.0  # what the planner is told when the link has no rate limit
Profiles = tuple[PrefillProfile, PrefillProfile, DecodeProfile]  # PD prefill, PrfaaS prefill, decode


def split_profiles(config: ServeConfig) -> Profiles:
    """The PD instance's prefill and decode profiles and the PrfaaS instance's prefill one."""
    sc = config.scheduler
    prefill, decode = load_pd_profiles(sc.profile)  # type: ignore[arg-type]
    prfaas = load_prefill_profile(sc.prfaas_profile) if sc.prfaas_profile else prefill
    return prefill, prfaas, decode


@dataclass(frozen=True, slots=True)
class Conversion:
    old: str
    new: str
    role: str  # the new role
    drain_s: float  # from the decision until the old worker held nothing
    start_s: float  # from then until the new worker was serving


class RoleChanger:
    def __init__(self, pool: Workers, config: ServeConfig, metrics: ServeMetrics) -> None:
        self.pool, self.config, self.metrics = pool, config, metrics
        self.counts: Counter[str] = Counter()  # to_prefill, to_decode, abandoned, refused
        self.done: list[Conversion] = []
        self.tasks: set[asyncio.Task] = set()

    def long_term(self, config: LongTermConfig, profiles: Profiles, threshold: int) -> LongTermControl | None:
        """The long-term policy over this deployment's planning case, now that its workers are attached."""
        prefill, prfaas, decode = profiles
        n_prfaas, n_p, n_d = (len(self.pool.of(c, r)) for c, r in STAGES)
        if n_p + n_d < 2:
            plan_log.warning("no re-planning: the PD cluster has %d worker(s), the planner needs 2", n_p + n_d)
            return None
        rate = parse_rate(self.config.link.rate)
        case = PlanCase(
            name="live",
            prfaas=prfaas,
            pd_prefill=prefill,
            decode=decode,
            lengths=LengthDistribution.empirical("until measured", [max(1, threshold)]),
            output_tokens=16.0,  # replaced by the measured mean before each plan
            n_prfaas=n_prfaas,
            n_pd=n_p + n_d,
            n_homogeneous=max(2, n_prfaas + n_p + n_d),
            link_gbps=rate / 1e9 if rate else UNLIMITED_LINK_GBPS,
        )
        sc = self.config.scheduler
        offered = dict(config=config, case=case, threshold=threshold, n_prefill=n_p, n_decode=n_d)
        with building(LONG_TERM, sc.long_term):
            if sc.long_term == "default":
                return LongTermPolicy(**(offered | dict(sc.long_term_args)))
            return load_policy(sc.long_term, LONG_TERM, sc.long_term_args, **offered)

    def replan(self, long: LongTermControl, short: ShortTermControl, signals: Signals, threshold: int) -> int:
        """The long-term policy's tick; returns t from now on (a plan that keeps the split sets the short-term
        policy's base; a converting plan's t applies once the worker serves in its new role)."""
        plan = long.step(signals)
        if plan is None:
            return threshold
        self.metrics.scheduler_decision("long_term", "convert" if plan.to_prefill else "plan", plan.reason)
        if not plan.to_prefill:
            return short.set_base(plan.threshold)

        def converted(ok: bool) -> None:  # take up the plan's t (at the next tick), or undo its split
            long.converted(plan, ok)
            if ok:
                short.set_base(plan.threshold)

        self.rebalance(plan.to_prefill, converted)
        return threshold

    def rebalance(self, to_prefill: int, done: Callable[[bool], None] = lambda ok: None) -> None:
        """Start |to_prefill| conversions, decode -> prefill when positive; each drains on its own and
        then calls ``done`` with whether it happened (False at once when no worker may go)."""
        for _ in range(abs(to_prefill)):
            worker = self.pick(to_prefill > 0) if not self.pool.closing else None
            if worker is None:
                self.counts["refused"] += 1
                self.metrics.role_change("prefill" if to_prefill > 0 else "decode", "refused")
                log.warning("rebalance: no PD worker can change role now (to_prefill %+d)", to_prefill)
                done(False)
                continue
            task = self.start(worker, "prefill" if to_prefill > 0 else "decode")
            task.add_done_callback(
                lambda t: done(not t.cancelled() and t.exception() is None and t.result() is not None)
            )

    def pick(self, to_prefill: bool) -> WorkerHandle | None:
        """The least busy worker of the shrinking role, or None when none may go."""
        shrinking = self.pool.of("pd", "decode" if to_prefill else "prefill")
        serving = [w for w in shrinking if w.spec.address is None and w.serving]
        prefill_elsewhere = any(w.serving for w in self.pool.of("prfaas", "prefill"))
        if not serving or (len(serving) == 1 and (to_prefill or not prefill_elsewhere)):
            return None
        return min(serving, key=lambda w: (w.busy, w.load_tokens, w.name))

    def start(self, worker: WorkerHandle, role: str) -> asyncio.Task[WorkerHandle | None]:
        """Drain ``worker`` and bring it back as ``role``, in the background."""
        if worker.cluster != "pd" or worker.role == role or role not in ("prefill", "decode"):
            raise ValueError(f"{worker.name} ({worker.cluster} {worker.role}) cannot become a {role} worker")
        if worker.spec.address is not None:
            raise ValueError(f"{worker.name} was started by hand: its role is its own command line's")
        if worker.draining:
            raise ValueError(f"{worker.name} is already changing role")
        worker.draining = True  # at once: from now on the router passes it by
        task = asyncio.get_running_loop().create_task(self._convert(worker, role))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _convert(self, old: WorkerHandle, role: str) -> WorkerHandle | None:
        pool, began = self.pool, time.monotonic()
        timeout = self.config.scheduler.drain_timeout
        log.info("worker %s: draining (%d requests) to become a %s worker", old.name, old.busy, role)
        try:
            async with asyncio.timeout(timeout):
                await old.wait_idle()
        except TimeoutError:
            old.draining = False
            self.counts["abandoned"] += 1
            self.metrics.role_change(role, "abandoned")
            log.warning("worker %s: still busy after %.0f s; it stays %s", old.name, timeout, old.role)
            return None
        drained = time.monotonic()
        if pool.closing:  # shutdown stops the old worker; a new one would outlive the gateway
            return None
        await pool.retire(old)
        spec = worker_spec(self.config, self._fresh_name(role), role, "pd", old.spec.device)  # its GPU, now free
        pool.known_names.add(spec.name)
        new: WorkerHandle | None = None
        while not pool.closing:  # the old worker is gone: keep trying, as the supervisor does for a dead one
            try:
                new = await pool.launch(spec)
                break
            except RuntimeError as e:
                log.error("worker %s did not start in its new role (%s); trying again", spec.name, e)
                await asyncio.sleep(RETRY_S)
        if pool.closing or new is None:  # shutdown began while it started, after it stopped the workers it knew of
            if new is not None:
                await pool.retire(new)
            return None
        self.counts[f"to_{role}"] += 1
        self.metrics.role_change(role, "done")
        self.done.append(Conversion(old.name, new.name, role, drained - began, time.monotonic() - drained))
        log.info("worker %s replaced %s: drained in %.1f s, serving %.1f s later",
                 new.name, old.name, drained - began, time.monotonic() - drained)  # fmt: skip
        return new

    def _fresh_name(self, role: str) -> str:
        prefix = NAME_PREFIX["pd", role]
        taken = {
            int(n[len(prefix) :]) for n in self.pool.known_names if n.startswith(prefix) and n[len(prefix) :].isdigit()
        }
        return f"{prefix}{next(i for i in itertools.count() if i not in taken)}"

    async def cancel(self) -> None:
        """Stop conversions in progress (at shutdown)."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
