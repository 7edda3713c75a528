"""The scheduler in the live gateway: the link and the worker queues sampled once a second into ``Signals``.

Each second ``run`` writes the signals to /metrics and steps the short-term policy, whose threshold and rule the
gateway's next route uses. With a profile, ``RoleChanger`` re-plans the PD split on the same ticks with the
long-term policy and carries it out; the codec policy picks each link transfer's codec.
"""

from __future__ import annotations

import asyncio
import math

from minifaas.config import ServeConfig
from minifaas.control.worker_ops import Exported, Prefilled
from minifaas.emulator.pacer import parse_rate
from minifaas.gateway.inter_cluster_link import NAME, InterClusterLink, LinkReading
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.roles import RoleChanger, split_profiles
from minifaas.gateway.workers import STAGES, Workers
from minifaas.model.layer_state import KVProfile
from minifaas.policy.codec_policy import MODES, CodecChoice, CodecSample, CompressionPolicy, LinkShare, TransferShape
from minifaas.policy.interfaces import CodecPolicy, LongTermControl, ShortTermControl
from minifaas.policy.long_term import LongTermConfig
from minifaas.policy.plugin import CODEC, SHORT_TERM, building, load_policy
from minifaas.policy.router import RouteDecision, Rule
from minifaas.policy.short_term import ShortTermConfig, ShortTermPolicy
from minifaas.policy.signals import PrefillSample, Signals, StageLoad

SPEED_WEIGHT = 0.3  # of the newest prefill in the speed average: a few prefills follow a change of load


class LiveScheduler:
    def __init__(
        self,
        pool: Workers,
        link: InterClusterLink,
        config: ServeConfig,
        metrics: ServeMetrics,
        roles: RoleChanger,
        kv: KVProfile,
        short_term: ShortTermConfig,
        long_term: LongTermConfig | None = None,
    ) -> None:
        self.pool, self.link, self.config, self.metrics, self.roles = pool, link, config, metrics, roles
        self.kv = kv  # the model's state sizes: each transfer's shape
        self.threshold, self.rule = config.threshold, Rule(config.cache.rule)
        sc = config.scheduler
        offered = dict(config=short_term, threshold=self.threshold, rule=self.rule)
        with building(SHORT_TERM, sc.short_term):
            self.short: ShortTermControl = (
                ShortTermPolicy(**(offered | dict(sc.short_term_args))) if sc.short_term == "default"
                else load_policy(sc.short_term, SHORT_TERM, sc.short_term_args, **offered)
            )  # fmt: skip
        self.utilisation = 0.0  # the short-term policy's smoothed reading of the link, as of its last step
        self.long_term = long_term
        self.profiles = split_profiles(config) if long_term is not None else None  # read now: a bad one fails at once
        self.long: LongTermControl | None = None  # built by ``prepare`` once the workers are known
        self.lengths: list[int] = []
        self.reading: LinkReading | None = None  # the link as last sampled
        self.last: Signals | None = None  # what the policies saw at the last tick
        self._prefills: list[PrefillSample] = []  # since the last tick
        self._outputs: list[int] = []  # completion tokens of the requests finished since the last tick
        self.speed: dict[str, float] = {}  # cluster -> prefill tokens/s, a moving average over recent prefills
        codec, codec_args = config.link.kv_compression, config.link.kv_compression_args
        with building(CODEC, codec):
            self.compression: CodecPolicy = (
                CompressionPolicy(**{"mode": codec, **dict(codec_args)}) if codec in MODES
                else load_policy(codec, CODEC, codec_args)
            )  # fmt: skip
        self.link_rate_bps = parse_rate(config.link.rate) or math.inf  # until the link is read
        metrics.set_threshold(self.threshold)

    def prepare(self) -> None:
        """The long-term policy over this deployment's planning case, now that its workers are attached."""
        if self.long_term is not None and self.profiles is not None:
            self.long = self.roles.long_term(self.long_term, self.profiles, self.threshold)

    async def run(self, period: float = 1.0) -> None:
        """Sample the link and the stage queues into /metrics, and tick the policies, until shutdown."""
        loop = asyncio.get_running_loop()
        while not self.pool.closing:
            reading = await self.link.sample(self.pool.of("prfaas", "prefill"), loop.time())
            if reading is not None:
                self.reading = reading
                self.metrics.set_link_health(NAME, reading.utilisation, reading.rtt_ms, reading.retrans_rate)
            for w in self.pool.workers.values():
                self.metrics.set_process(w.name, w.alive, w.rejoins)
            for name in self.link.emulators():
                self.metrics.set_process(name, name not in self.link.down, self.link.restarts[name])
            for stage, (cluster, role) in zip(("prfaas_prefill", "pd_prefill", "decode"), STAGES, strict=True):
                self.metrics.set_queue_depth(stage, sum(w.requests for w in self.pool.of(cluster, role)))
            if not self.pool.closing:  # shutdown may have begun while the link answered: start no conversion now
                self.tick(loop.time())
            await asyncio.sleep(period)

    def prefilled(self, cluster: str, tokens: int, seconds: float) -> None:
        """A prefill ended on ``cluster`` after ``seconds`` for ``tokens`` computed: its measured speed."""
        if tokens <= 0 or seconds <= 0:
            return
        self._prefills.append(PrefillSample(cluster, tokens, seconds))
        old = self.speed.get(cluster)
        self.speed[cluster] = (
            tokens / seconds if old is None else SPEED_WEIGHT * tokens / seconds + (1 - SPEED_WEIGHT) * old
        )

    def finished(self, completion_tokens: int) -> None:
        if completion_tokens > 0:
            self._outputs.append(completion_tokens)

    def codec(self, tokens: int = 0, computed: int = 0, link_start: int = 0) -> CodecChoice:
        """The codec for a transfer about to cross the link: the state of a ``tokens`` prompt from
        ``link_start`` on, ``computed`` of its tokens prefilled on PrfaaS (its own request already holds
        a PrfaaS worker). Without tokens, the rule for a transfer with nothing to hide behind."""
        busy = sum(w.busy for w in self.pool.of("prfaas", "prefill"))
        link = LinkShare(self.link_rate_bps, self.utilisation, max(0, busy - 1))
        shape = self._shape(tokens, computed, link_start) if tokens else TransferShape(1.0)
        choice = self.compression.choose(link, shape)
        self.metrics.codec_chosen(choice.codec, choice.reason, choice.break_even_bps)
        return choice

    def _shape(self, tokens: int, computed: int, link_start: int) -> TransferShape:
        fixed = self.kv.bytes_at(0)
        nbytes = self.kv.bytes_at(tokens) - (self.kv.bytes_at(link_start) - fixed)
        chunk = self.config.prfaas.prefill_chunk
        tail = self.kv.bytes_at(min(chunk, computed)) if chunk else nbytes  # the fixed state and the last chunk's KV
        speed = self.speed.get("prfaas")
        return TransferShape(nbytes, computed / speed if speed else 0.0, tail)

    def coded(self, reply: Prefilled | Exported, nbytes: int) -> None:
        """A transfer across the link ended: what its codec did (a worker's ``coding`` fields)."""
        codec = reply.codec or "none"
        wire, encode_s, decode_s = reply.kv_wire_bytes, reply.kv_encode_s, reply.kv_decode_s
        self.compression.observe(CodecSample(codec, nbytes, wire, encode_s, decode_s))
        self.metrics.kv_coded(codec, nbytes, wire, encode_s, decode_s)

    def calibrated(self, samples: dict[str, list[float]]) -> None:
        """A PrfaaS prefill worker's start-up measurement of its codecs (nbytes, wire, encode s, decode s)."""
        for codec, (nbytes, wire, encode_s, decode_s) in samples.items():
            self.compression.observe(CodecSample(codec, int(nbytes), int(wire), encode_s, decode_s))

    def observe(self, decision: RouteDecision) -> None:
        """A request was routed: remember how much of it had to be prefilled."""
        self.lengths.append(decision.incremental_tokens)

    def signals(self, now: float) -> Signals:
        reading, self.reading = self.reading, None if self.reading is None else _spent(self.reading)
        lengths, self.lengths = tuple(self.lengths), []
        prefills, self._prefills = tuple(self._prefills), []
        outputs, self._outputs = tuple(self._outputs), []
        if reading is not None:
            self.link_rate_bps = reading.rate_bps
        decode = self._stage("pd", "decode")
        slots = sum(w.max_batch or self.config.pd.max_batch for w in self.pool.of("pd", "decode") if w.serving)
        backlog_s = 0.0
        if reading is not None and not self.link.emulated and 0 < reading.rate_bps < math.inf:
            backlog_s = 8 * sum(w.queued_bytes for w in self.pool.of("prfaas", "prefill")) / reading.rate_bps
        return Signals(
            now_s=now,
            link_rate_bps=reading.rate_bps if reading is not None else math.inf,
            egress_bps=reading.egress_bps if reading is not None else 0.0,
            prfaas=self._stage("prfaas", "prefill"),
            pd_prefill=self._stage("pd", "prefill"),
            decode=decode,
            rtt_ms=reading.rtt_ms if reading is not None else 0.0,
            retrans_rate=reading.retrans_rate if reading is not None else 0.0,
            link_backlog_s=backlog_s,
            decode_occupancy=min(1.0, decode.depth / slots) if slots else 0.0,
            lengths=lengths,
            prefills=prefills,
            output_tokens=outputs,
        )

    def tick(self, now: float) -> None:
        signals = self.last = self.signals(now)
        decision = self.short.step(signals)
        self.rule, self.utilisation = decision.rule, decision.utilisation
        self.metrics.scheduler_decision("short_term", decision.action, decision.reason)
        threshold = decision.threshold
        if self.long is not None:
            threshold = self.roles.replan(self.long, self.short, signals, threshold)
        if threshold != self.threshold:
            self.metrics.set_threshold(threshold)
        self.threshold = threshold

    def _stage(self, cluster: str, role: str) -> StageLoad:
        """Draining workers do not serve the stage; their requests still count in its depth."""
        workers = self.pool.of(cluster, role)
        serving = [w for w in workers if w.serving]
        wait = 0.0
        if role == "prefill" and serving and self.speed.get(cluster):
            wait = min(w.load_tokens for w in serving) / self.speed[cluster]
        return StageLoad(len(serving), sum(w.busy for w in workers), wait)


def _spent(reading: LinkReading) -> LinkReading:
    """A reading once a tick has used it: the same ceiling and rtt, nothing new sent or retransmitted."""
    return LinkReading(0.0, reading.rate_bps, reading.rtt_ms)
