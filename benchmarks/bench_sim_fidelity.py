"""How well the simulator predicts the live system: one trace slice served by ``minifaas serve`` and simulated.

    python benchmarks/bench_sim_fidelity.py [--trace mooncake|azure] [--load light|near-capacity]
        [--requests N] [--json] [--quick] [--save FILE]
    python benchmarks/bench_sim_fidelity.py --from FILE [--json]

1. Profile: ``minifaas profile`` of the served model on this machine (prefill latency and state bytes per
   prompt length, decode step time per batch size), written to the file the simulator's ``--pd-profile``
   reads, and the lossless codec measured on a prefill's state as a PrfaaS worker measures it at start. Then
   the prefill as the live workers run it (``calibrate``): once the server is up, each profiled length
   sent alone a few times as fresh tokens, the median of the forward time each worker reports; the twin runs
   on that, since a worker's forward also feeds its layer sink while its event loop sends. Then short PD
   prompts timed while a long PrfaaS prompt prefills give the prefill's slowdown beside one other worker
   computing (``contended``): the twin's ``contention``, which the simulator scales past that by the count of
   workers taking turns on the cores; timed beside a batch of the slice's median prompt decoding, its
   ``beside_decode``; and the client's TTFT beyond the prefill, alone, its ``delivery_s``. Last, PD prompts
   queued behind each other give a worker's own time between two forwards (``turnaround``): the twin's
   ``prefill_turnaround_s``. The calibration's transfers the workers coded give the lossless codec as served
   (``served_codec``), which the twin's codec policy weighs in place of the start-up figure. The same calibration
   runs again after the replay, and the twin takes each figure
   halfway between the two (``Calibration.mean``): the box's speed drifts over a run, and the replay runs
   between them.
2. Deployment: the live flags (``LIVE_FLAGS`` and the threshold and cache block chosen for the trace) go
   through ``minifaas serve``'s own parser to a ``ServeConfig``; ``twin`` turns that into the ``SimConfig``
   with the same worker counts per cluster, decode batch bound, threshold and scheduler settings, routing rule
   and spill, link rate and RTT, layer pipelining, prefix cache and snapshot policy, and codec policy, loaded
   by name as the gateway loads them; the first token at the prefill's end and repeated prompts served whole,
   as the workers do; prompts of one length batched into one forward as the workers batch them; and every
   worker on this machine's cores (``shared_cores``), as they run here; a decode step timed by its rows.
3. Slice: the trace's first ``--requests`` requests. Prompt lengths are divided by ``LENGTH_DIVISOR`` (a
   Mooncake hash id becomes a fixed block of token ids, so prefixes are shared as in the trace, and the
   cache's block is the scaled 512-token block), outputs by ``OUTPUT_DIVISOR`` (at most ``MAX_OUTPUT``), and
   time is scaled so the slice arrives at ``--load`` of the capacity the profile predicts for it
   (``capacity_rps``: the busiest of the prefill pools, the decode rows and the link, each worker slowed as
   when all of them compute on this machine's cores).
4. Live: ``minifaas serve --port 0`` in a child process; each request a streamed completion sent at its
   scaled arrival time. Simulated: the same slice through ``Simulation`` with the twin.

Printed, live beside simulated with the signed relative error (sim - live) / live: TTFT mean, p50, p90 and
p99; end-to-end latency mean and p90; output tokens/s; requests per route; prefix-cache hit tokens; KV bytes
on the link. Four simulated columns: the twin on the workers' prefill; the same on the model's alone
(``model alone``: ``minifaas profile``'s prefill); with each worker on cores of its own (``own cores``: what
sharing this machine's cores adds); and the twin at live speed (``at_live_speed``:
each cluster's prefill slowed by what its live workers took over what the profile charges, the decode step
the live gap between tokens), which leaves the simulator's own model (queues, routing, the link) as the
error. Then the requests the twin at live speed misses most, with their routes, and where live TTFT goes by
route (the gateway's per-request breakdown, the client's HTTP round trip) beside the profile's prefill time,
and the live prefill beside the profile's by band of uncached tokens (``prefill_by_length``); last, the twin's
TTFT error with its prefill 5% faster and 5% slower (``prefill_sensitivity``): how closely a profile must match
the loaded workers; and its error on the calibration before the replay alone, and on the one after alone.
``--json`` ends with one JSON object: ``ttft_mean_err``, ``ttft_p90_err``, ``throughput_err`` and the other
errors of the twin, ``model_alone``, ``own_cores``, ``at_live_speed``, ``before_only`` and ``after_only`` with
the same of the others, both calibrations' figures, the trace, the load and the scaling. ``--quick`` is the short
slice the tests run (40 requests); the same code path. ``--save FILE`` keeps the live run (the profiles, both
calibrations, the scaling and every stream) and ``--from FILE`` simulates it
again with the simulator of the day, so a model change is measured on the same live runs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, astuple, dataclass, fields, replace
from pathlib import Path

import aiohttp
import numpy as np
from bench_scale import Stream, client, serving, stream
from bench_trace_replay import arrivals

from minifaas import figures
from minifaas.commands import serve as serve_command
from minifaas.commands.arguments import output_file, positive_int
from minifaas.config import ServeConfig
from minifaas.emulator.pacer import parse_rate
from minifaas.model.decoder import MAX_HOLD_S
from minifaas.model.loader import ModelSpec, load_config_dict
from minifaas.planner.profile import (
    DecodeProfile,
    PrefillProfile,
    decode_from_dict,
    load_pd_profiles,
    prefill_from_dict,
    profile_tables,
)
from minifaas.policy.codec_policy import CodecEstimate
from minifaas.policy.router import RouterConfig, Rule
from minifaas.policy.short_term import ShortTermConfig
from minifaas.sim.deployment import SimConfig
from minifaas.sim.fluid_link import LinkConfig
from minifaas.sim.simulator import PRFAAS, Simulation
from minifaas.sim.workload import Workload
from minifaas.traces import MOONCAKE_BLOCK_TOKENS, read_trace

MODEL = "shakespeare-qwen3.5"  # bench_scale's stream() names it in every request
TRACES = {"mooncake": "mooncake-synthetic", "azure": "azure-conv"}
LENGTH_DIVISOR = {"mooncake": 32, "azure": 4}  # a 2-core box prefills a few hundred tokens in tens of ms
OUTPUT_DIVISOR, MAX_OUTPUT = 8, 64
THRESHOLD = {"mooncake": 512, "azure": 384}  # near each scaled trace's median prompt: both routes carry load
LOADS = {"light": 0.3, "near-capacity": 0.85}
LIVE_FLAGS = [
    "--model", MODEL, "--prfaas-workers", "1", "--pd-prefill-workers", "1", "--pd-decode-workers", "1",
    "--fixed-threshold", "--link-rate", "100mbit", "--link-delay-ms", "5",
]  # fmt: skip
PROFILE_BATCHES = "1,4,16,64"
DECODE_STREAMS = 8  # decoding while a contended prefill is timed
CONTENDED_TOKENS, CONTENDED_LONG = 128, 2048  # a PD prompt timed beside a PrfaaS one
CONTENDED_ROUNDS = 3
# PD prompts queued at once, to time the worker between forwards: together shorter than the spill margin
TURNAROUND_PROMPTS, TURNAROUND_TOKENS, TURNAROUND_ROUNDS = 6, 64, 3


@dataclass(frozen=True)
class Slice:
    """The first requests of a trace, lengths scaled down; times in the trace's seconds from the first."""

    name: str
    tokens: list[list[int]]  # each prompt's token ids
    at_s: np.ndarray
    output_tokens: np.ndarray
    hash_ids: tuple[tuple[int, ...], ...] | None
    block_tokens: int  # the tokens one hash id stands for: the live cache's block

    @property
    def prompts(self) -> np.ndarray:
        return np.array([len(t) for t in self.tokens], dtype=np.int64)

    def workload(self, time_scale: float) -> Workload:
        """The requests as the simulator takes them (and the client sends them), time multiplied by this."""
        at = self.at_s * time_scale
        return Workload(self.name, at, self.prompts, self.output_tokens, self.hash_ids, self.block_tokens)


# --- the profile and the twin -------------------------------------------------------------------------------


def profile(lengths: list[int], threads: int, out: Path) -> tuple[PrefillProfile, DecodeProfile]:
    """``minifaas profile`` of the model on this machine with a worker's torch threads, read back as the
    simulator reads a ``--pd-profile``. The twin takes its decode batch bound from the deployment, not from the
    SLO's BS_max, so the SLO asked is one every step meets: a loaded box's slow steps still give a table."""
    argv = [sys.executable, "-m", "minifaas.commands.main", "profile", "--model", MODEL, "--out", str(out),
            "--lengths", ",".join(map(str, lengths)), "--batches", PROFILE_BATCHES, "--repeats", "5",
            "--slo", "0.001"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)
    return load_pd_profiles(out)


def lossless_codec() -> CodecEstimate:
    """The lossless codec on a real prefill's state, measured as a PrfaaS worker calibrates at start."""
    from minifaas.codec.codec import Codec
    from minifaas.model.runtime import ModelRuntime
    from minifaas.transport.codec_probe import probe
    from minifaas.worker.worker_process import CALIBRATION_PROMPT

    sample = probe(ModelRuntime.load(MODEL, "cpu").prefill(CALIBRATION_PROMPT).state, Codec.LOSSLESS)
    return CodecEstimate(sample.ratio, sample.nbytes / sample.encode_s, sample.nbytes / sample.decode_s)


@dataclass(frozen=True)
class Calibration:
    """The served workers' prefill alone, and how much slower it runs beside others, timed once."""

    prefill: PrefillProfile
    contention: tuple[float, ...]  # a prefill's time over its time alone, with 1 and 2 workers computing
    delivery_s: float  # a first token's time at the client beyond its prefill: the gateway and HTTP
    beside_decode: float  # a prefill's time over its time alone while a batch decodes beside it, nothing else
    turnaround_s: float  # a prefill worker's own time from one forward's end to the next one's start, alone
    codec: CodecEstimate | None = None  # lossless as the workers coded the calibration's transfers (None: none)

    def mean(self, other: Calibration) -> Calibration:
        """Each figure halfway between this calibration's and ``other``'s, taken on the same lengths: the box's
        speed drifts, and a replay timed between two calibrations runs at neither's."""
        points = tuple(replace(a, latency_s=(a.latency_s + b.latency_s) / 2)
                       for a, b in zip(self.prefill.points, other.prefill.points, strict=True))  # fmt: skip
        return Calibration(
            replace(self.prefill, points=points),
            tuple((a + b) / 2 for a, b in zip(self.contention, other.contention, strict=True)),
            (self.delivery_s + other.delivery_s) / 2,
            (self.beside_decode + other.beside_decode) / 2,
            (self.turnaround_s + other.turnaround_s) / 2,
            CodecEstimate(*((a + b) / 2 for a, b in zip(astuple(self.codec), astuple(other.codec), strict=True)))
            if self.codec is not None and other.codec is not None else self.codec or other.codec,
        )  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self) | {"prefill": profile_tables(self.prefill)["prefill"]}

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        contention = tuple(data["contention"][:2])  # a run saved with a third figure, beside two others: not used
        codec = CodecEstimate(**data["codec"]) if data.get("codec") else None
        return cls(**data | {"prefill": prefill_from_dict(data["prefill"]), "contention": contention, "codec": codec})


async def calibrate(url: str, model: PrefillProfile, context: int, seed: int, repeats: int = 5) -> Calibration:
    """Each of the model profile's lengths sent alone ``repeats`` times as fresh token ids (no cached prefix),
    routed as the router routes it: the median of the ``prefill_s`` its worker reports is the prefill (the state
    bytes stay the profile's; a longer prompt never counts faster), and the median of the client's TTFT beyond
    it the delivery. Then ``contended``, ``CONTENDED_ROUNDS`` times: the same on PD beside a PrfaaS prefill, and
    beside a batch decoding ``context``-token prompts. Last ``turnaround``.
    The prompts' token ids come from ``seed``: a second calibration on the same server needs another."""
    rng = np.random.default_rng(seed)
    points, slowest, beyond, coded = [], 0.0, [], []
    async with client() as http:
        for ids in ([5] * 8, [6] * (2 * THRESHOLD["mooncake"])):  # first-call costs of each route, not timed
            await stream(http, url, ids, 1)
        for q in model.points:
            taken = []
            for _ in range(repeats):
                done = await stream(http, url, rng.integers(0, 256, q.tokens).tolist(), 1)
                if done.status != 200:
                    raise RuntimeError(f"a {q.tokens}-token calibration prompt failed with {done.status}")
                taken.append(float(done.info["prefill_s"]))
                beyond.append(done.ttft - taken[-1])
                if done.info.get("kv_codec") == "lossless":
                    coded.append(done.info)
            slowest = max(slowest, statistics.median(taken))
            points.append(replace(q, latency_s=slowest))
        prefill = replace(model, points=tuple(points), latency_coeffs=())
        alone = float(prefill.latency_s(CONTENDED_TOKENS))
        beside = []
        for decoding in (False, True):
            taken = [s for _ in range(CONTENDED_ROUNDS)
                     for s in await contended(http, url, rng, decoding, context)]  # fmt: skip
            if not taken:  # a round may end before a prompt beside it does; all of them, not
                raise RuntimeError(f"no prompt finished beside the others in {CONTENDED_ROUNDS} rounds")
            beside.append(statistics.median(taken) / alone)
        turn_s = await turnaround(http, url, rng)
    contention = (1.0, max(1.0, beside[0]))
    return Calibration(prefill, contention, statistics.median(beyond), max(1.0, beside[1]), turn_s, served_codec(coded))


def served_codec(records: list[dict]) -> CodecEstimate | None:
    """Lossless as the workers coded these transfers, each a request's record: their state over their bytes on the
    wire and over their seconds of coding at each end. Served, coding a transfer costs more than the start-up
    figure says, and the gateway's policy soon weighs what served transfers report."""
    nbytes = sum(r["kv_bytes"] for r in records)
    encode_s, decode_s = sum(r["kv_encode_s"] for r in records), sum(r["kv_decode_s"] for r in records)
    if not nbytes or encode_s <= 0 or decode_s <= 0:
        return None
    return CodecEstimate(nbytes / sum(r["kv_wire_bytes"] for r in records), nbytes / encode_s, nbytes / decode_s)


async def turnaround(http: aiohttp.ClientSession, url: str, rng: np.random.Generator) -> float:
    """A prefill worker's own time between forwards (keeping a prompt's blocks, the next one's turn, planning
    it): ``TURNAROUND_PROMPTS`` fresh PD prompts of distinct lengths (none shares a forward), sent 2 ms apart so
    all queue behind the first. A prompt's turn comes at its sending, the gateway's dispatch and its queue at the
    worker; from one turn to the next, less the forward between, is a turnaround. The median of every round's."""
    gaps = []
    for _ in range(TURNAROUND_ROUNDS):
        tasks = []
        for k in range(TURNAROUND_PROMPTS):
            ids = rng.integers(0, 256, TURNAROUND_TOKENS + k).tolist()
            tasks.append(asyncio.create_task(stream(http, url, ids, 1)))
            await asyncio.sleep(0.002)
        done = await asyncio.gather(*tasks)
        if any(d.status != 200 or d.info.get("route") != "local" for d in done):
            raise RuntimeError(f"a turnaround prompt failed or left PD: {[(d.status, d.info) for d in done]}")
        turns = sorted((d.sent + d.info["dispatch_s"] + d.info["queue_s"], d.info["prefill_s"]) for d in done)
        gaps += [after - turn - forward for (turn, forward), (after, _) in itertools.pairwise(turns)]
    return max(0.0, statistics.median(gaps))


async def contended(
    http: aiohttp.ClientSession, url: str, rng: np.random.Generator, decoding: bool, context: int
) -> list[float]:
    """The ``prefill_s`` of fresh ``CONTENDED_TOKENS``-token prompts, one after another on PD, while a fresh long
    prompt prefills on PrfaaS (until its first token) or, with ``decoding``, ``DECODE_STREAMS`` streams of
    ``context``-token prompts decode (until they end)."""
    batch = [Stream() for _ in range(DECODE_STREAMS if decoding else 0)]
    tasks = [asyncio.create_task(stream(http, url, rng.integers(0, 256, context).tolist(), 4 * MAX_OUTPUT, out=s))
             for s in batch]  # fmt: skip
    while not all(s.arrivals for s in batch) and not any(t.done() for t in tasks):  # all decoding, then begin
        await asyncio.sleep(0.005)
    long = Stream()
    if decoding:
        beside = asyncio.gather(*tasks)
    else:
        beside = asyncio.create_task(stream(http, url, rng.integers(0, 256, CONTENDED_LONG).tolist(), 1, out=long))
    taken = []
    while not long.arrivals and not beside.done():
        done = await stream(http, url, rng.integers(0, 256, CONTENDED_TOKENS).tolist(), 1)
        if not long.arrivals and not beside.done() and done.status == 200:
            taken.append(float(done.info["prefill_s"]))
    await beside
    if (not decoding and long.status != 200) or any(len(s.tokens) < 4 * MAX_OUTPUT for s in batch):
        raise RuntimeError(
            f"the contended calibration's long prompt ({long.status}) or streams failed: "
            f"{[(s.status, len(s.tokens)) for s in batch]}"
        )
    return taken


def serve_config(flags: list[str]) -> ServeConfig:
    """What ``minifaas serve FLAGS`` runs, through its own parser."""
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    return serve_command.config_from_args(parser.parse_args(flags))


def batch_tokens(serve: ServeConfig) -> int:
    """The prefill workers' batch budget, which the simulator holds to one value for both clusters."""
    if serve.pd.prefill_batch != serve.prfaas.prefill_batch:
        raise ValueError("the twin needs one prefill_batch for both clusters")
    return serve.pd.prefill_batch


def twin(serve: ServeConfig, cal: Calibration, decode: DecodeProfile, lossless: CodecEstimate) -> SimConfig:
    """The simulated deployment of ``serve``: its counts, policies and link, on the measured profiles, with the
    workers' prefill as calibrated: alone, beside other workers on this machine, their turnaround between
    forwards and the delivery of its tokens."""
    model = load_config_dict(ModelSpec.resolve(serve.model, serve.seed))
    rate = parse_rate(serve.link.rate)
    cache = serve.cache
    return SimConfig(
        prfaas=cal.prefill,
        pd_prefill=cal.prefill,
        # a decode worker batches what its memory holds (or --max-batch), not the SLO's BS_max: the admission
        # bound on requests in flight is the live cap
        decode=replace(decode, bs_max=serve.pd.max_batch or serve.max_queued_requests or 10**6),
        n_prfaas=serve.prfaas.prefill_workers,
        n_prefill=serve.pd.prefill_workers,
        n_decode=serve.pd.decode_workers,
        threshold=serve.threshold,
        rule=Rule(cache.rule),
        router=RouterConfig(
            cache.moves,
            cache.incremental_transfer,
            spill_tokens=serve.spill_tokens,
            max_link_backlog_s=serve.max_link_backlog_s,
        ),
        link=LinkConfig(
            gbps=rate / 1e9 if rate else 1e6,
            rtt_s=2 * serve.link.delay_ms / 1000,
            pipeline_layers=int(model["num_hidden_layers"]) if serve.link.pipelined else 0,
        ),
        prefix_cache=cache.mode != "none",
        cache_bytes=cache.capacity_mib * 2**20 * serve.pd.prefill_workers,  # a pool per cluster, not per node
        snapshot_interval_blocks=cache.snapshot_interval_blocks,
        snapshot_policy=cache.snapshot_policy,
        snapshot_args=cache.snapshot_policy_args,
        short_term=ShortTermConfig(enabled=not serve.fixed_threshold, ceiling=int(model["max_position_embeddings"])),
        early_first_token=True,  # the gateway sends the first token as the prefill worker has it
        whole_prompt_hits=True,  # a prefill worker serves a repeated prompt from its end snapshot
        shared_cores=len(os.sched_getaffinity(0)),  # every worker of the live deployment on this machine
        contention=cal.contention,
        beside_decode=cal.beside_decode,
        delivery_s=cal.delivery_s,
        decode_step_by_batch=True,  # a decode worker steps the rows it has
        decode_hold=1.0 if serve.pd.device == "cpu" else 0.0,  # as worker_process gives a CPU decode worker
        decode_hold_max_s=MAX_HOLD_S,
        prefill_batch_tokens=batch_tokens(serve),
        prefill_turnaround_s=cal.turnaround_s,
        kv_compression=serve.link.kv_compression,
        kv_compression_args=serve.link.kv_compression_args,
        codecs=(("lossless", cal.codec or lossless),),  # the codec as served, where the calibration coded
        router_policy=serve.router,
        router_args=serve.router_args,
        short_term_policy=serve.scheduler.short_term,
        short_term_args=serve.scheduler.short_term_args,
    )


# --- the slice ----------------------------------------------------------------------------------------------


def capacity_rps(config: SimConfig, prompts: np.ndarray, outputs: np.ndarray) -> float:
    """Requests/s the profile says the deployment holds for these lengths: the inverse of the busiest stage's
    seconds per request (prefix hits ignored). At capacity every worker computes, so each takes the twin's
    slowdown for all of them at once; a decode row costs a large batch's step slope, its rows padded to the
    slice's 99th-percentile prompt."""
    long = prompts > config.threshold
    prefill_s = config.pd_prefill.latency_s(prompts)
    decode, width = config.decode, int(np.percentile(prompts, 99))
    largest = decode.steps[-1][0]  # PROFILE_BATCHES: past it, a row adds the last measured slope
    row_s = decode.step_s(largest + 1, width) - decode.step_s(largest, width)
    busiest = max(
        prefill_s[long].sum() / len(prompts) / max(config.n_prfaas, 1),
        prefill_s[~long].sum() / len(prompts) / max(config.n_prefill, 1),
        outputs.mean() * row_s / config.n_decode,
    )
    slowdown = config.slowdown(config.n_prfaas + config.n_prefill + config.n_decode)
    link = config.prfaas.kv_bytes(prompts[long]).sum() * 8 / len(prompts) / (config.link.gbps * 1e9)
    return 1.0 / max(busiest * slowdown, link)


def trace_slice(trace: str, requests: int) -> Slice:
    """The first ``requests`` of the trace: prompts / ``LENGTH_DIVISOR`` as token ids (bench_trace_replay's),
    outputs / ``OUTPUT_DIVISOR`` (bench_trace_replay caps them at 4: it measures TTFT alone)."""
    divisor = LENGTH_DIVISOR[trace]
    sent = arrivals(TRACES[trace], divisor, requests)
    full = read_trace(TRACES[trace], length_scale=1.0 / divisor)
    at = np.array([a.at_s for a in sent])
    outputs = np.clip(np.rint(full.output_tokens[:requests] / OUTPUT_DIVISOR), 1, MAX_OUTPUT).astype(np.int64)
    ids = full.hash_ids[:requests] if full.hash_ids is not None else None
    block = max(1, MOONCAKE_BLOCK_TOKENS // divisor)
    return Slice(f"{TRACES[trace]}[:{requests}]", [a.tokens for a in sent], at - at[0], outputs, ids, block)


def profile_lengths(longest: int) -> list[int]:
    """Prompt lengths to profile: 8, 32, 128 and so on (fourfold) below the slice's longest, and the longest."""
    return [n for n in (8, 32, 128, 512, 2048, 8192) if n < longest] + [max(longest, 16)]


# --- the two timelines --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timeline:
    """One side's requests, in slice order; times from each request's arrival."""

    ttft_s: np.ndarray
    e2e_s: np.ndarray
    output_tokens: np.ndarray
    prfaas: np.ndarray  # bool: prefilled on PrfaaS
    hit_tokens: int
    link_bytes: float  # KV of PrfaaS transfers on the link, after coding
    makespan_s: float  # first arrival to last token

    def figures(self) -> dict[str, float]:
        return {
            "ttft_mean": float(self.ttft_s.mean()),
            "ttft_p50": float(np.percentile(self.ttft_s, 50)),
            "ttft_p90": float(np.percentile(self.ttft_s, 90)),
            "ttft_p99": float(np.percentile(self.ttft_s, 99)),
            "e2e_mean": float(self.e2e_s.mean()),
            "e2e_p90": float(np.percentile(self.e2e_s, 90)),
            "throughput": float(self.output_tokens.sum() / self.makespan_s),
            "prfaas_requests": int(self.prfaas.sum()),
            "local_requests": int((~self.prfaas).sum()),
            "prefix_hit_tokens": self.hit_tokens,
            "link_bytes": self.link_bytes,
        }


async def replay(url: str, sl: Slice, workload: Workload) -> tuple[list[Stream], list[float]]:
    """Each prompt streamed at its arrival time; the streams and how late each was sent."""
    at, outputs = workload.arrival_s, workload.output_tokens
    async with client() as http:
        for ids in ([7] * 64, [9] * (2 * THRESHOLD["mooncake"])):  # first-call costs of each route, not timed
            await stream(http, url, ids, 2)
        start = time.perf_counter()

        async def one(k: int) -> Stream:
            await asyncio.sleep(max(0.0, start + at[k] - time.perf_counter()))
            return await stream(http, url, sl.tokens[k], int(outputs[k]))

        streams = await asyncio.gather(*(one(k) for k in range(len(at))))
    return streams, [s.sent - start - at[k] for k, s in enumerate(streams)]


def live_timeline(streams: list[Stream]) -> Timeline:
    bad = [k for k, s in enumerate(streams) if s.status != 200 or not s.arrivals]
    if bad:
        raise RuntimeError(f"requests {bad[:5]} failed (status {streams[bad[0]].status})")
    start = min(s.sent for s in streams)
    prfaas = np.array([s.info.get("route") == "prfaas" for s in streams])
    return Timeline(
        ttft_s=np.array([s.ttft for s in streams]),
        e2e_s=np.array([s.arrivals[-1] - s.sent for s in streams]),
        output_tokens=np.array([len(s.arrivals) for s in streams]),
        prfaas=prfaas,
        hit_tokens=sum(int(s.info.get("cached_tokens", 0)) for s in streams),
        link_bytes=float(sum(s.info.get("kv_wire_bytes", 0) for s, p in zip(streams, prfaas) if p)),
        makespan_s=max(s.arrivals[-1] for s in streams) - start,
    )


def simulated_timeline(config: SimConfig, workload: Workload) -> Timeline:
    sim = Simulation(config, workload)
    sim.run()
    arrival = workload.arrival_s
    finished = np.array(sim.finished)
    return Timeline(
        ttft_s=np.array(sim.first_token) - arrival,
        e2e_s=finished - arrival,
        output_tokens=workload.output_tokens,
        prfaas=np.array(sim.path) == PRFAAS,
        hit_tokens=int(sim.cached_tokens),
        link_bytes=float(sim.coding.wire_bytes),
        makespan_s=float(finished.max() - arrival[0]),
    )


def at_live_speed(config: SimConfig, streams: list[Stream], live: Timeline) -> SimConfig:
    """The twin with each cluster's prefill as slow, over the profile, as its live workers were in this run, and
    a decode step as long as the live streams' mean gap between tokens after the second: what is left of the
    error is the simulator's model (queues, routing, the link), not the machine's speed under this run's load."""
    changes: dict[str, object] = {}
    for field, on_prfaas in (("prfaas", True), ("pd_prefill", False)):
        taken = [s.info for s, p in zip(streams, live.prfaas) if p == on_prfaas]
        profile: PrefillProfile = getattr(config, field)
        if not taken:
            continue
        charged = profile.latency_s(np.array([max(1, i["prompt_tokens"] - i["cached_tokens"]) for i in taken]))
        slower = sum(i["prefill_s"] for i in taken) / float(charged.sum())
        changes[field] = profile.slowed(slower)
    # from the second token on: the first leaves before the state's tail, the second waits for it
    decoding = [s.arrivals for s in streams if len(s.arrivals) > 2]
    if decoding:
        step = sum(a[-1] - a[1] for a in decoding) / sum(len(a) - 2 for a in decoding)
        changes["decode"] = replace(config.decode, step_time_s=step, steps=())  # one step time for every batch
    # the live speed has the sharing, and the live gap between tokens the hold
    return replace(config, shared_cores=0, decode_hold=0.0, **changes)  # type: ignore[arg-type]


# --- the report ---------------------------------------------------------------------------------------------

ROWS = (  # (label, figure, format)
    ("TTFT mean (s)", "ttft_mean", ".3f"),
    ("TTFT p50 (s)", "ttft_p50", ".3f"),
    ("TTFT p90 (s)", "ttft_p90", ".3f"),
    ("TTFT p99 (s)", "ttft_p99", ".3f"),
    ("end-to-end mean (s)", "e2e_mean", ".3f"),
    ("end-to-end p90 (s)", "e2e_p90", ".3f"),
    ("output tokens/s", "throughput", ".1f"),
    ("requests via PrfaaS", "prfaas_requests", "d"),
    ("requests via PD-P", "local_requests", "d"),
    ("prefix hit tokens", "prefix_hit_tokens", ",d"),
    ("link bytes (KV)", "link_bytes", ",.0f"),
)
PARTS = ("dispatch_s", "queue_s", "prefill_s", "store_s", "control_s")  # the gateway's TTFT breakdown


def prefill_sensitivity(
    config: SimConfig, workload: Workload, live: dict[str, float], scales: tuple[float, ...] = (0.95, 1.05)
) -> dict[str, dict[str, float | None]]:
    """The twin's TTFT mean and p90 errors with both clusters' prefill times multiplied by each of ``scales``: how
    closely the profile must match the loaded workers for the TTFT to fall within a given error."""
    out = {}
    for scale in scales:
        sim = simulated_timeline(
            replace(config, prfaas=config.prfaas.slowed(scale), pd_prefill=config.pd_prefill.slowed(scale)), workload
        ).figures()
        out[str(scale)] = {f"{key}_err": relative_error(sim[key], live[key]) for key in ("ttft_mean", "ttft_p90")}
    return out


def relative_error(sim: float, live: float) -> float | None:
    return None if live == 0 else (sim - live) / live


def print_comparison(live: dict, simulated: dict[str, tuple[dict, dict]]) -> None:
    """Live beside each simulated column (name -> (figures, errors)) and its signed error."""
    print(f"{'':22}{'live':>14}" + "".join(f"{name:>14}{'error':>8}" for name in simulated))
    for label, key, fmt in ROWS:
        row = f"{label:22}{format(live[key], fmt):>14}"
        for figures_, errors in simulated.values():
            err = errors[f"{key}_err"]
            row += f"{format(figures_[key], fmt):>14}{'-' if err is None else f'{err:+.0%}':>8}"
        print(row)


def print_deviations(live: Timeline, sim: Timeline, fitted: Timeline, streams: list[Stream], count: int = 6) -> None:
    """The requests whose TTFT the twin at live speed misses most (the simulator's model, not the profile)."""
    route = {True: "prfaas", False: "pd"}
    print(f"\nlargest TTFT deviations at live speed (of {len(live.ttft_s)} requests):")
    print(f"  {'req':>4} {'prompt':>7} {'hit':>6} {'route live/sim':>15} {'live s':>8} {'sim s':>8} {'at speed':>9}")
    for k in np.argsort(-np.abs(fitted.ttft_s - live.ttft_s))[:count]:
        prompt, hit = streams[k].info["prompt_tokens"], int(streams[k].info.get("cached_tokens", 0))
        routes = f"{route[bool(live.prfaas[k])]}/{route[bool(fitted.prfaas[k])]}"
        print(f"  {k:>4} {prompt:>7} {hit:>6} {routes:>15} {live.ttft_s[k]:>8.3f} {sim.ttft_s[k]:>8.3f} "
              f"{fitted.ttft_s[k]:>9.3f}")  # fmt: skip


def breakdown(streams: list[Stream], live: Timeline, config: SimConfig) -> dict[str, dict[str, float]]:
    """Per live route, mean seconds of TTFT by part (the gateway's record, and the client's HTTP round trip
    on top of the gateway's TTFT), beside the profile's time for the same uncached tokens (what the simulator
    charges) and the live prefill's time over it."""
    out = {}
    for route, on_prfaas in (("prfaas", True), ("pd", False)):
        taken = [(s, t) for s, t, p in zip(streams, live.ttft_s, live.prfaas) if p == on_prfaas]
        if not taken:
            continue
        row = {part: statistics.fmean(s.info.get(part) or 0.0 for s, _ in taken) for part in PARTS}
        row["http_s"] = statistics.fmean(t - (s.info.get("ttft_s") or 0.0) for s, t in taken)
        uncached = [max(1, s.info["prompt_tokens"] - s.info.get("cached_tokens", 0)) for s, _ in taken]
        row["profile_prefill_s"] = float(config.pd_prefill.latency_s(np.array(uncached)).mean())
        row["prefill_over_profile"] = row["prefill_s"] / row["profile_prefill_s"]
        out[route] = row | {"requests": len(taken)}
    return out


LENGTH_BANDS = (1, 16, 64, 256, 1024, 2**31)  # uncached tokens


def prefill_by_length(streams: list[Stream], config: SimConfig) -> list[dict[str, float]]:
    """Live prefill time beside the profile's, by band of uncached tokens: a slowdown that is a multiple of the
    profile's is the same in every band; one that adds a fixed time per forward shows most in the short ones."""
    tokens = np.array([max(1, s.info["prompt_tokens"] - s.info.get("cached_tokens", 0)) for s in streams])
    live = np.array([s.info["prefill_s"] for s in streams])
    charged = config.pd_prefill.latency_s(tokens)
    rows = []
    for low, high in itertools.pairwise(LENGTH_BANDS):
        band = (tokens >= low) & (tokens < high)
        if band.any():
            rows.append({"tokens_from": low, "tokens_to": high, "requests": int(band.sum()),
                         "live_s": float(live[band].mean()), "profile_s": float(charged[band].mean())})  # fmt: skip
    return rows


def print_breakdown(parts: dict[str, dict[str, float]]) -> None:
    heads = (*PARTS, "http_s", "profile_prefill_s")
    print("\nwhere live TTFT goes, mean s" + "".join(f"{h.removesuffix('_s'):>10}" for h in heads) + "  live/profile")
    for route, row in parts.items():
        label = f"  {route} ({row['requests']:.0f})"
        cells = "".join(f"{row[h]:>10.4f}" for h in heads)
        print(f"{label:28}{cells}{row['prefill_over_profile']:>13.2f}x")


@dataclass(frozen=True)
class LiveRun:
    """One live replay of a slice and what its twin is built from; ``--save`` writes it as JSON and ``--from``
    simulates it again, with the simulator as it is then, without serving anything."""

    trace: str
    load: str
    requests: int
    flags: list[str]  # minifaas serve's
    before: Calibration  # the served workers, timed before the replay (``calibrate``)
    model: PrefillProfile  # minifaas profile's prefill, the model alone
    decode: DecodeProfile
    lossless: CodecEstimate
    time_scale: float
    capacity_rps: float
    streams: list[Stream]
    late_s: list[float]  # how late each request was sent
    wall_s: float
    after: Calibration | None = None  # the same, timed again after the replay; None in a run saved before it was

    @property
    def calibration(self) -> Calibration:
        """What the twin runs on: halfway between the two calibrations, or the one before where there is no other."""
        return self.before if self.after is None else self.before.mean(self.after)

    def write(self, path: Path) -> None:
        tables = {"model": profile_tables(self.model)["prefill"],
                  "decode": profile_tables(decode=self.decode)["decode"], "lossless": asdict(self.lossless),
                  "streams": [asdict(s) for s in self.streams], "before": self.before.to_dict(),
                  "after": self.after and self.after.to_dict()}  # fmt: skip
        plain = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in tables}
        path.write_text(json.dumps(plain | tables) + "\n")

    @classmethod
    def read(cls, path: Path) -> LiveRun:
        data = json.loads(path.read_text())
        if "before" not in data:  # saved with one calibration, its figures among the run's
            names = ("contention", "delivery_s", "beside_decode", "turnaround_s")
            data["before"] = {"prefill": data.pop("workers")} | {k: data.pop(k, 0.0) for k in names}
        return cls(**data | {
            "model": prefill_from_dict(data["model"]), "decode": decode_from_dict(data["decode"]),
            "lossless": CodecEstimate(**data["lossless"]), "streams": [Stream(**s) for s in data["streams"]],
            "before": Calibration.from_dict(data["before"]),
            "after": data.get("after") and Calibration.from_dict(data["after"]),
        })  # fmt: skip


def live_run(trace: str, load: str, requests: int) -> LiveRun:
    """Profile the model, serve it, time the workers' prefill, scale the slice to the load, replay it live, time
    the workers' prefill again."""
    started = time.perf_counter()
    sl = trace_slice(trace, requests)
    flags = [*LIVE_FLAGS, "--threshold", str(THRESHOLD[trace]), "--cache-block-size", str(sl.block_tokens)]
    serve = serve_config(flags)
    with tempfile.TemporaryDirectory(prefix="bench-sim-fidelity-") as tmp:
        lengths = profile_lengths(int(sl.prompts.max()))
        model, decode = profile(lengths, serve.worker_threads("prfaas"), Path(tmp) / "profile.json")
    lossless = lossless_codec()
    context = max(8, int(np.median(sl.prompts)))
    with serving(flags) as server:
        before = asyncio.run(calibrate(server.url, model, context, seed=11))
        capacity = capacity_rps(twin(serve, before, decode, lossless), sl.prompts, sl.output_tokens)
        trace_rate = (len(sl.at_s) - 1) / max(sl.at_s[-1], 1e-9)
        time_scale = trace_rate / (LOADS[load] * capacity)
        workload = sl.workload(time_scale)
        print(f"replaying {len(workload)} requests over {workload.duration_s:.1f} s", file=sys.stderr, flush=True)
        streams, late = asyncio.run(replay(server.url, sl, workload))
        print("calibrating again", file=sys.stderr, flush=True)
        after = asyncio.run(calibrate(server.url, model, context, seed=12))
    wall_s = time.perf_counter() - started
    return LiveRun(trace, load, requests, flags, before, model, decode, lossless, time_scale, capacity, streams, late,
                   wall_s, after)  # fmt: skip


def report(run: LiveRun, as_json: bool) -> None:
    """The run beside its twin and the twin's variants: the table, the deviations, the breakdowns, the JSON."""
    sl = trace_slice(run.trace, run.requests)
    workload = sl.workload(run.time_scale)
    serve, cal = serve_config(run.flags), run.calibration
    config = twin(serve, cal, run.decode, run.lossless)
    print(f"{run.trace} ({sl.name}), {run.load}: {len(workload)} requests over {workload.duration_s:.1f} s; "
          f"prompts / {LENGTH_DIVISOR[run.trace]}, outputs / {OUTPUT_DIVISOR} (at most {MAX_OUTPUT}), "
          f"time x{run.time_scale:.3g}: {workload.rate:.2f} req/s, {LOADS[run.load]:.0%} of the "
          f"{run.capacity_rps:.2f} req/s the profile predicts")  # fmt: skip
    print(
        f"profile: prefill {run.model.latency_s(256):.4f} s at 256 tokens, the model alone; decode step "
        f"{run.decode.step_s(1) * 1e3:.2f}-{run.decode.step_time_s * 1e3:.2f} ms at batch 1-{run.decode.bs_max}; "
        f"serve {' '.join(run.flags)}"
    )
    shown = [("before the replay", run.before)]
    if run.after is not None:
        shown += [("after it", run.after), ("for the twin, halfway", cal)]
    for name, c in shown:
        print(f"  calibrated {name}: prefill {c.prefill.latency_s(256):.4f} s at 256 tokens in the workers; "
              f"beside 0/1 others computing {' / '.join(f'{x:.2f}x' for x in c.contention)}, beside a "
              f"decoding batch alone {c.beside_decode:.2f}x; turnaround between forwards "
              f"{c.turnaround_s * 1e3:.1f} ms; delivery {c.delivery_s * 1e3:.1f} ms; lossless as served "
              + (f"x{c.codec.ratio:.2f}, {c.codec.encode_bps / 1e6:.0f} / {c.codec.decode_bps / 1e6:.0f} MB/s"
                 if c.codec is not None else "not coded"))  # fmt: skip
    streams = run.streams
    live = live_timeline(streams)
    sim_started = time.perf_counter()
    sim = simulated_timeline(config, workload)
    sim_s = time.perf_counter() - sim_started
    fitted = simulated_timeline(at_live_speed(config, streams, live), workload)
    own = simulated_timeline(replace(config, shared_cores=0), workload)
    alone = simulated_timeline(replace(config, prfaas=run.model, pd_prefill=run.model), workload)
    live_f, sim_f, fitted_f, own_f = live.figures(), sim.figures(), fitted.figures(), own.figures()
    alone_f = alone.figures()
    errors = {f"{key}_err": relative_error(sim_f[key], live_f[key]) for key in live_f}
    fitted_errors = {f"{key}_err": relative_error(fitted_f[key], live_f[key]) for key in live_f}
    own_errors = {f"{key}_err": relative_error(own_f[key], live_f[key]) for key in live_f}
    alone_errors = {f"{key}_err": relative_error(alone_f[key], live_f[key]) for key in live_f}
    one_calibration = {}  # the twin on the calibration before the replay alone, and on the one after alone
    if run.after is not None:
        for name, c in (("before_only", run.before), ("after_only", run.after)):
            one = simulated_timeline(twin(serve, c, run.decode, run.lossless), workload).figures()
            one_calibration[name] = {f"{key}_err": relative_error(one[key], live_f[key]) for key in live_f}
    print(
        f"sent late: median {statistics.median(run.late_s) * 1e3:.1f} ms, max {max(run.late_s) * 1e3:.1f} ms; "
        f"simulated in {sim_s * 1e3:.0f} ms\n"
    )
    columns = {"simulated": (sim_f, errors), "model alone": (alone_f, alone_errors), "own cores": (own_f, own_errors)}
    print_comparison(live_f, {**columns, "at live speed": (fitted_f, fitted_errors)})
    for name, errs in one_calibration.items():
        print(
            f"the twin on the calibration {name.replace('_', ' ')}: TTFT mean {errs['ttft_mean_err']:+.1%}, "
            f"p90 {errs['ttft_p90_err']:+.1%}, output tokens/s {errs['throughput_err']:+.1%}"
        )
    print_deviations(live, sim, fitted, streams)
    parts = breakdown(streams, live, config)
    print_breakdown(parts)
    bands = prefill_by_length(streams, config)
    print("\nlive prefill over the profile's, by uncached tokens (both routes):")
    for band in bands:
        live_ms, profile_ms = band["live_s"] * 1e3, band["profile_s"] * 1e3
        print(f"  [{band['tokens_from']}, {band['tokens_to']}) {band['requests']:>4} requests: live {live_ms:7.1f} ms, "
              f"profile {profile_ms:7.1f} ms, {live_ms / profile_ms:.2f}x, {live_ms - profile_ms:+.1f} ms")  # fmt: skip
    sensitivity = prefill_sensitivity(config, workload, live_f)
    print("\nthe twin's TTFT error with its prefill (both clusters) a little slower or faster:")
    for scale, errs in sensitivity.items():
        print(f"  x{scale}: TTFT mean {errs['ttft_mean_err']:+.1%}, p90 {errs['ttft_p90_err']:+.1%}")
    if as_json:
        out = {
            "bench": "sim_fidelity", "trace": TRACES[run.trace], "load": run.load, "load_fraction": LOADS[run.load],
            "requests": len(workload), "length_divisor": LENGTH_DIVISOR[run.trace],
            "output_divisor": OUTPUT_DIVISOR, "time_scale": run.time_scale, "offered_rps": workload.rate,
            "capacity_rps": run.capacity_rps, "late_max_s": max(run.late_s), "simulate_s": sim_s,
            "wall_s": run.wall_s, "live": live_f, "sim": sim_f, "ttft_parts": parts,
            "prefill_by_length": bands, **errors,
            "sim_at_live_speed": fitted_f, "at_live_speed": fitted_errors, "sim_own_cores": own_f,
            "own_cores": own_errors, "sim_model_alone": alone_f, "model_alone": alone_errors,
            "model_prefill_256_s": float(run.model.latency_s(256)),
            "worker_prefill_256_s": float(cal.prefill.latency_s(256)),
            "contention": list(cal.contention), "delivery_s": cal.delivery_s, "beside_decode": cal.beside_decode,
            "turnaround_s": cal.turnaround_s, "prefill_sensitivity": sensitivity, **one_calibration,
            "calibrations": {
                name: {"prefill_256_s": float(c.prefill.latency_s(256))}
                | {k: v for k, v in asdict(c).items() if k != "prefill"}
                for name, c in (("before", run.before), ("after", run.after)) if c is not None
            },
        }  # fmt: skip
        print(figures.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", choices=TRACES, default="mooncake", help="Mooncake synthetic or Azure conversation")
    p.add_argument("--load", choices=LOADS, default="near-capacity", help="offered load, of the profiled capacity")
    p.add_argument("--requests", type=positive_int, default=400, help="the first this many requests of the trace")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every figure")
    p.add_argument("--quick", action="store_true", help="a short slice, the same code path")
    p.add_argument("--save", type=output_file, metavar="FILE", help="also write the live run here (JSON), for --from")
    p.add_argument(
        "--from", dest="recorded", type=Path, metavar="FILE",
        help="simulate a run --save wrote, beside its live figures, without serving (its trace, load and size)",
    )  # fmt: skip
    args = p.parse_args()
    if args.quick:  # flags given on the command line still win
        p.set_defaults(requests=40)
        args = p.parse_args()
    if args.recorded:
        run = LiveRun.read(args.recorded)
    else:
        run = live_run(args.trace, args.load, args.requests)
        if args.save:
            run.write(Path(args.save))
    report(run, args.json)


if __name__ == "__main__":
    main()
