"""One step of the device check in its own process: ``python benchmarks/gpu_probe.py STEP [flags]``; one JSON line.

A process that loaded a model on the CPU has fla blocked (``model.kernels``) and one that loaded it on CUDA has fla
imported, so the CPU reference and the GPU run of a comparison are two processes that meet in a file. Every step
fails (exit 1, ``"ok": false`` and its ``failures``) on a non-finite figure, and fails when ``--device cuda:N`` has
no CUDA: only ``--device cpu`` (the dry run) runs without one.

Steps:
  env        versions, the GPU and ``nvidia-smi``
  reference  on the CPU in float32: a prefill, the same prompt continued from its first half, and greedy decode
             steps with their logits, saved for ``kernels``
  kernels    the kernel label (``fla`` on CUDA), the Triton kernels that ran, and the reference's three runs
             repeated on the device: prefill, prefill continued from the CPU-made prefix, decode of the CPU-made
             state; float32 within 1e-4 of the largest magnitude, bfloat16 reported
  movement   bfloat16, bitwise: the device state, its pinned staging and a real KVSender/KVReceiver transfer give
             equal states, tokens and logits
  scale      a model built from a config (random weights): prefill ms per token by length, peak memory, KV bytes
             per token by layer kind, a chunked prefill streamed with and without staging, warmed decode by batch,
             and the decode rows sized under a one-third memory fraction
  serve      ``minifaas serve`` on the device: cold start, one long and one short greedy request equal to an
             in-process run
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # before any minifaas import: the check runs from a bare checkout

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402
from request_path import wait_healthy  # noqa: E402  (benchmarks/, this script's folder)

from minifaas.model.batch_decoder import make_decoder  # noqa: E402
from minifaas.model.decode_memory import device_memory, row_bytes, sized_for  # noqa: E402
from minifaas.model.decoder import DecoderConfig  # noqa: E402
from minifaas.model.host_copy import HostCopier, build_cache  # noqa: E402
from minifaas.model.interleaved_decoder import forward_one, generate  # noqa: E402
from minifaas.model.kernels import select_kernels  # noqa: E402
from minifaas.model.layer_state import LayerState, ModelState  # noqa: E402
from minifaas.model.loader import ModelSpec, config_from_dict, load_config_dict  # noqa: E402
from minifaas.model.runtime import ModelRuntime  # noqa: E402
from minifaas.model.sampling import SamplingParams  # noqa: E402
from minifaas.model.tokenizer import ByteTokenizer  # noqa: E402
from minifaas.transport.outgoing import KVSender, OutgoingTransfer, SenderConfig  # noqa: E402
from minifaas.transport.receiver import KVReceiver, ReceiverConfig  # noqa: E402
from minifaas.worker.prefill_service import TransferSink  # noqa: E402

SECRET = b"gpu-probe-secret-0123456789abcdef"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FP32_TOLERANCE = 1e-4  # fla against the torch reference: largest error over the largest magnitude
DECODE_STEPS = 8


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 + 7 * salt) % 256 for i in range(n)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def host(state: ModelState) -> ModelState:
    """A synchronous copy of ``state`` in host memory: the reference every other copy is held to."""
    layers = [LayerState(s.layer, s.kind, s.seq_len, tuple((n, t.cpu()) for n, t in s.slots)) for s in state.layers]
    return ModelState(layers, state.seq_len)


def like(state: ModelState, template: ModelState) -> ModelState:
    """``state`` with each slot in the dtype the template's slot has (a float32 reference for a bfloat16 model)."""
    layers = [
        LayerState(
            s.layer,
            s.kind,
            s.seq_len,
            tuple((n, t.to(u.dtype)) for (n, t), (_, u) in zip(s.slots, r.slots, strict=True)),
        )
        for s, r in zip(state.layers, template.layers, strict=True)
    ]
    return ModelState(layers, state.seq_len)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| over the largest |want|; inf when either holds a NaN or an infinity."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return math.inf
    return float((got - want).abs().max() / max(float(want.abs().max()), 1e-12))


def state_err(got: ModelState, want: ModelState) -> float:
    return max(
        rel_err(a, b)
        for s, r in zip(got.layers, want.layers, strict=True)
        for (_, a), (_, b) in zip(s.slots, r.slots, strict=True)
    )


def same_bits(got: ModelState, want: ModelState) -> bool:
    return all(
        torch.equal(a.cpu(), b.cpu())
        for s, r in zip(got.layers, want.layers, strict=True)
        for (_, a), (_, b) in zip(s.slots, r.slots, strict=True)
    )


@torch.no_grad()
def decode_logits(rt: ModelRuntime, state: ModelState, token: int, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy steps from ``state`` (any device: the cache is built on the runtime's), each step's logits kept."""
    cache = build_cache(rt.config, state.layers, rt.device)
    tokens, logits = [token], []
    for _ in range(steps):
        out = forward_one(rt, cache, tokens[-1])
        logits.append(out)
        tokens.append(int(out.argmax()))
    return tokens, torch.stack(logits)


STARTED = time.perf_counter()


def note(what: str) -> None:
    """Progress on stderr, so a step killed at its limit shows how far it got."""
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {what}", file=sys.stderr, flush=True)


def one_autotune_config() -> None:
    """Every Triton autotuner keeps only its smallest config (least shared memory, so it fits any shape): each
    kernel compiles once instead of once per config. Results are the same kernels at another tiling; a check of
    correctness needs no tuning, and compiling every config of every fla kernel takes minutes."""
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def smallest(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        configs = prune(self, *args, **kwargs)
        size = lambda c: (sum(v for v in c.kwargs.values() if isinstance(v, int)), c.num_stages, c.num_warps)  # noqa: E731
        return [min(configs, key=size)]

    Autotuner.prune_configs = smallest


def check_cuda(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"{device} asked for, but torch {torch.__version__} sees no CUDA device")


def finish(result: dict) -> dict:
    """``ok`` from the failures, and a failure for every figure that is not finite."""
    bad = [k for k, v in flat(result) if isinstance(v, float) and not math.isfinite(v)]
    result["failures"] = result.get("failures", []) + [f"{k} is not finite" for k in bad]
    result["ok"] = not result["failures"]
    return result


def flat(value: object, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(value, dict):
        return [kv for k, v in value.items() for kv in flat(v, f"{prefix}{k}.")]
    if isinstance(value, list):
        return [kv for i, v in enumerate(value) for kv in flat(v, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), value)]


# -- env ------------------------------------------------------------------------------------------------------


def env(device: str) -> dict:
    import importlib.metadata as md

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "absent"

    names = (
        "torch",
        "triton",
        "transformers",
        "flash-linear-attention",
        "fla-core",
        "huggingface-hub",
        "tokenizers",
        "aiohttp",
        "numpy",
        "zstandard",
        "setproctitle",
        "xxhash",
        "prometheus-client",
        "rich",
    )
    out: dict = {"python": platform.python_version(), "versions": {n: version(n) for n in names}, "failures": []}
    out["cuda"] = torch.version.cuda
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        out["gpu"] = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "count": torch.cuda.device_count(),
        }
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        out["failures"] += [
            f"{n} is not installed"
            for n in ("flash-linear-attention", "fla-core", "triton")
            if out["versions"][n] == "absent"
        ]
    return out


# -- reference and kernels ------------------------------------------------------------------------------------


@torch.no_grad()
def three_runs(
    rt: ModelRuntime,
    ids: list[int],
    prefix: ModelState | None = None,
    decode_from: tuple[ModelState, int] | None = None,
) -> dict:
    """The prompt's prefill; its second half continued from ``prefix`` (default: its own first half's state, copied
    to the host); greedy decode steps from ``decode_from`` (default: the prefill's state), each step's logits kept."""
    full = rt.prefill(ids)
    half = len(ids) // 2
    if prefix is None:
        prefix = host(rt.prefill(ids[:half]).state)
    cont = rt.prefill(ids[half:], prefix_state=prefix)
    state, token = decode_from or (full.state, full.next_token)
    tokens, logits = decode_logits(rt, state, token, DECODE_STEPS)
    return {"full": full, "prefix": prefix, "cont": cont, "decode_tokens": tokens, "decode_logits": logits}


def load(model: str, device: str, dtype: torch.dtype) -> ModelRuntime:
    """A preset or checkpoint by name; a family's config file (``models/families/*.json``) with seeded random
    weights made on the CPU in float32, so the CPU and the device hold the same ones. On CUDA with
    ``MINIFAAS_PROBE_ONE_CONFIG=1``, one autotune config per Triton kernel."""
    if device.startswith("cuda") and os.environ.get("MINIFAAS_PROBE_ONE_CONFIG") == "1":
        select_kernels(device)
        one_autotune_config()
    note(f"loading {model} on {device} in {dtype}")
    if not model.endswith(".json"):
        return ModelRuntime.load(model, device, dtype=dtype)
    return config_model(model, device, dtype, init_on_device=False)


def reference_file(folder: str, model: str) -> str:
    return str(Path(folder) / f"{Path(model).stem}.pt")


def reference(models: list[str], tokens: int, folder: str) -> dict:
    """Each model's three runs on the CPU in float32, saved as ``folder/<name>.pt``."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    labels = {}
    for model in models:
        rt = load(model, "cpu", torch.float32)
        ids = prompt(tokens)
        runs = three_runs(rt, ids)
        full = runs["full"]
        torch.save(
            {
                "ids": ids,
                "logits": full.logits,
                "state": host(full.state),
                "next_token": full.next_token,
                "prefix": runs["prefix"],
                "cont_logits": runs["cont"].logits,
                "cont_state": host(runs["cont"].state),
                "decode_tokens": runs["decode_tokens"],
                "decode_logits": runs["decode_logits"],
            },
            reference_file(folder, model),
        )
        labels[model] = rt.kernels.label
    return finish({"models": models, "tokens": tokens, "kernels": labels})


class TritonLaunches:
    """Counts every Triton kernel launch by kernel name, at ``JITFunction.run`` (autotuned kernels pass there too)."""

    def __init__(self, device: str) -> None:
        self.counts: Counter[str] = Counter()
        self.device = device
        self._jit = None

    def __enter__(self) -> TritonLaunches:
        if not self.device.startswith("cuda"):  # a CPU process keeps Triton out; fla is blocked there
            return self
        from triton.runtime.jit import JITFunction

        original, counts = JITFunction.run, self.counts

        def run(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
            counts[f"{fn.fn.__module__}.{fn.fn.__name__}"] += 1
            return original(fn, *args, **kwargs)

        self._jit = (JITFunction, original)
        JITFunction.run = run
        return self

    def __exit__(self, *exc: object) -> None:
        if self._jit is not None:
            self._jit[0].run = self._jit[1]


def profiled_kernels(fn, device: str) -> list[dict]:  # type: ignore[no-untyped-def]
    """The device kernels ``fn()`` ran, by name, as torch's profiler saw them (the 15 that took longest)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    rows = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    return [{"name": e.key[:90], "calls": e.count, "us": round(e.device_time_total, 1)} for e in rows[:15]]


def kernels(model: str, device: str, dtype_name: str, against: str) -> dict:
    check_cuda(device)
    dtype = DTYPES[dtype_name]
    rt = load(model, device, dtype)
    ref = torch.load(reference_file(against, model), weights_only=False)
    ids = ref["ids"]
    report = rt.kernels.to_json()
    out: dict = {"model": model, "dtype": dtype_name, "device": device, **report, "failures": []}
    if device.startswith("cuda") and report["kernels"] not in ("fla", "none"):
        out["failures"].append(f"kernel label {report['kernels']!r} on {device}, expected 'fla'")
    note("first prefill (Triton compiles and autotunes here)")
    template = rt.prefill(ids).state  # compiled and autotuned outside the counts; the dtype of each state slot
    prefix = like(ref["prefix"], rt.prefill(ids[: len(ids) // 2]).state)
    note("compiled; the three runs")
    with TritonLaunches(device) as launches:
        runs = three_runs(rt, ids, prefix, (like(ref["state"], template), ref["next_token"]))
        sync(device)
    out["triton_launches"] = sum(launches.counts.values())
    out["triton_kernels"] = dict(launches.counts.most_common(20))
    if device.startswith("cuda") and report["kernels"] == "fla" and not launches.counts:
        out["failures"].append("no Triton kernel ran on the fla path")
    if device == "cpu" and sys.modules.get("fla") is not None:
        out["failures"].append("fla was imported in a CPU process")
    note("profiling one prefill")
    try:
        out["profiled"] = profiled_kernels(lambda: rt.prefill(ids), device)
    except Exception as e:  # the profiler is a report, not the check
        out["profiled"] = f"profiler failed: {e!r}"
    full, cont = runs["full"], runs["cont"]
    gpu_decode_tokens, gpu_decode_logits = decode_logits(rt, full.state, full.next_token, DECODE_STEPS)
    errors = {
        "prefill_logits": rel_err(full.logits, ref["logits"]),
        "prefill_state": state_err(host(full.state), ref["state"]),
        "continued_logits": rel_err(cont.logits, ref["cont_logits"]),
        "continued_state": state_err(host(cont.state), ref["cont_state"]),
        "cpu_state_decoded_logits": rel_err(runs["decode_logits"], ref["decode_logits"]),
        "own_state_decoded_logits": rel_err(gpu_decode_logits, ref["decode_logits"]),
    }
    out["errors"] = errors
    out["tokens_equal"] = {
        "prefill": full.next_token == ref["next_token"],
        "cpu_state_decode": runs["decode_tokens"] == ref["decode_tokens"],
        "own_state_decode": gpu_decode_tokens == ref["decode_tokens"],
    }
    out["tolerance"] = FP32_TOLERANCE if dtype is torch.float32 else None
    if dtype is torch.float32:
        out["failures"] += [f"{k} error {v:.3g} over {FP32_TOLERANCE}" for k, v in errors.items() if v > FP32_TOLERANCE]
    return finish(out)


# -- movement -------------------------------------------------------------------------------------------------


class HostFirst:
    """An outgoing transfer's put, each layer copied to host memory in the forward's thread first (no
    staging): what the transfer costs without the side-stream copies."""

    def __init__(self, wire: OutgoingTransfer) -> None:
        self.wire = wire

    def put_threadsafe(self, state: LayerState, start: int = 0, total: int | None = None) -> None:
        self.wire.put_threadsafe(host(ModelState([state], state.seq_len)).layers[0], start, total)


async def transfer(rt: ModelRuntime, ids: list[int], chunk: int, staged: bool, connections: int = 4) -> dict:
    """One prefill streamed through a real KVSender to a KVReceiver on loopback: each layer staged to pinned host
    memory on a side stream (``staged``), or copied synchronously in the forward's thread first."""
    async with KVReceiver(ReceiverConfig(SECRET)) as rx:  # noqa: SIM117 (the sender needs the receiver's port)
        async with KVSender(SenderConfig("127.0.0.1", rx.port, SECRET, connections=connections)) as tx:
            async with tx.stream(1, rt.num_states) as wire:
                sink = TransferSink(wire if staged else HostFirst(wire), 0, len(ids))  # type: ignore[arg-type]
                start = time.perf_counter()
                result = await asyncio.to_thread(
                    rt.prefill, ids, on_layer=sink.put_layer, chunk_tokens=chunk, on_tokens=sink.put_tokens
                )
                sync(rt.device)
                computed = time.perf_counter()
            state = await rx.transfer(1).model_state()
            done = time.perf_counter()
    return {
        "result": result,
        "received": state,
        "prefill_s": computed - start,
        "tail_s": done - computed,
        "copy_wait_s": wire.copy_wait_s,
        "kv_bytes": state.nbytes,
    }


def movement(model: str, device: str, tokens: int) -> dict:
    check_cuda(device)
    rt = load(model, device, torch.bfloat16)
    ids = prompt(tokens, salt=1)
    first = rt.prefill(ids, chunk_tokens=64)
    sync(device)
    device_state = first.state
    synchronous = host(device_state)
    copier = HostCopier(device)
    staged_layers = []
    for layer in device_state.layers:
        copy, done = copier.stage(layer)
        if done is not None:
            done.synchronize()
        staged_layers.append(copy)
    staged = ModelState(staged_layers, device_state.seq_len)
    note("staged; now a real transfer")
    sent = asyncio.run(asyncio.wait_for(transfer(rt, ids, 64, staged=True), 120))
    failures = []
    pinned = all(t.is_pinned() for s in staged.layers for _, t in s.slots) if copier.stream is not None else None
    if copier.stream is not None and not pinned:
        failures.append("the staged state is not in pinned host memory")
    if not same_bits(staged, synchronous):
        failures.append("the staged state differs from a synchronous copy")
    sent_sync = host(sent["result"].state)
    if not same_bits(sent["received"], sent_sync):
        failures.append("the received state differs from a synchronous copy of the sender's")
    decodes = {
        "device": decode_logits(rt, device_state, first.next_token, DECODE_STEPS),
        "staged": decode_logits(rt, staged, first.next_token, DECODE_STEPS),
        "synchronous": decode_logits(rt, synchronous, first.next_token, DECODE_STEPS),
        "received": decode_logits(rt, sent["received"], sent["result"].next_token, DECODE_STEPS),
        "sender_device": decode_logits(rt, sent["result"].state, sent["result"].next_token, DECODE_STEPS),
    }
    for a, b in (("staged", "device"), ("synchronous", "device"), ("received", "sender_device")):
        if decodes[a][0] != decodes[b][0] or not torch.equal(decodes[a][1], decodes[b][1]):
            failures.append(f"decode from the {a} state differs from the {b} state's (tokens or logits)")
    return finish(
        {
            "model": model,
            "device": device,
            "dtype": "bfloat16",
            "tokens": tokens,
            "pinned": pinned,
            "kv_bytes": sent["kv_bytes"],
            "repeat_prefill_bitwise": same_bits(sent_sync, synchronous),
            "decode_tokens": decodes["device"][0],
            "failures": failures,
        }
    )


# -- scale ----------------------------------------------------------------------------------------------------


def config_model(
    config: str, device: str, dtype: torch.dtype, init_on_device: bool = True, shrink: bool = False
) -> ModelRuntime:
    """A model built from a config file with seeded random weights: made on ``device`` in ``dtype`` (fast for a
    large one), or on the CPU in float32 and then moved. ``shrink`` keeps its layer kinds and head shapes at four
    layers and a narrow width (the dry run of a large config)."""
    select_kernels(device)
    from transformers import AutoModelForCausalLM

    spec = ModelSpec.resolve(str(config if Path(config).is_absolute() else ROOT / config))
    raw = load_config_dict(spec)
    if shrink:
        raw = {
            **raw,
            "num_hidden_layers": 4,
            "layer_types": raw["layer_types"][:4],
            "hidden_size": 128,
            "intermediate_size": 256,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 512,
        }
    torch.manual_seed(0)
    if init_on_device:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config_from_dict(raw), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(config_from_dict(raw), dtype=torch.float32).to(device, dtype)
    rt = ModelRuntime(model.eval(), ByteTokenizer(), spec, device)
    return rt


def timed(fn, device: str) -> float:  # type: ignore[no-untyped-def]
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def kv_bytes_by_kind(state: ModelState) -> dict:
    by_kind: dict[str, dict] = {}
    for s in state.layers:
        row = by_kind.setdefault(s.kind.name.lower(), {"layers": 0, "bytes": 0})
        row["layers"] += 1
        row["bytes"] += s.nbytes
    for name, row in by_kind.items():
        row["bytes_per_token" if name == "full_attention" else "fixed_bytes"] = (
            round(row["bytes"] / state.seq_len, 1) if name == "full_attention" else row["bytes"]
        )
    return by_kind


def scale(
    config: str, device: str, lengths: list[int], stream_tokens: int, batches: list[int], fraction: float, shrink: bool
) -> dict:
    check_cuda(device)
    cuda = device.startswith("cuda")
    rt = config_model(config, device, torch.bfloat16, shrink=shrink)
    weights = torch.cuda.memory_allocated(device) if cuda else 0
    out: dict = {
        "config": config,
        "device": device,
        "dtype": "bfloat16",
        "kernels": rt.kernels.label,
        "parameters": sum(p.numel() for p in rt.model.parameters()),
        "prefill": {},
        "failures": [],
    }
    if cuda and rt.kernels.label != "fla":
        out["failures"].append(f"kernel label {rt.kernels.label!r} on {device}, expected 'fla'")
    for n in lengths:
        note(f"prefill of {n} tokens")
        ids = prompt(n, salt=n)
        row = {}
        for chunk in (0, 512):
            rt.prefill(ids, chunk_tokens=chunk)  # warmed at this length and chunking
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            seconds = timed(lambda ids=ids, chunk=chunk: rt.prefill(ids, chunk_tokens=chunk), device)
            row[f"chunk_{chunk}"] = {
                "ms_per_token": round(1e3 * seconds / n, 5),
                "tok_s": round(n / seconds),
                "peak_gib_over_weights": round((torch.cuda.max_memory_allocated(device) - weights) / 2**30, 3)
                if cuda
                else None,
            }
        out["prefill"][str(n)] = row
    state = rt.prefill(prompt(stream_tokens, salt=3)).state
    out["kv_by_kind"] = kv_bytes_by_kind(state)
    del state
    ids = prompt(stream_tokens, salt=3)
    note("streamed prefill")
    streamed = {}
    for staged in (True, False, True):  # the first staged run warms sockets and the copy stream
        got = asyncio.run(asyncio.wait_for(transfer(rt, ids, 512, staged=staged), 300))
        streamed["staged" if staged else "synchronous"] = {
            k: round(got[k], 4) for k in ("prefill_s", "tail_s", "copy_wait_s")
        }
        streamed["kv_bytes"] = got["kv_bytes"]
        if not same_bits(got["received"], host(got["result"].state)):
            out["failures"].append(f"streamed ({'staged' if staged else 'synchronous'}): received state differs")
        del got
    out["streamed"] = {"tokens": stream_tokens, "chunk": 512, **streamed}
    note("decode by batch")
    out["decode"] = decode_rates(rt, batches)
    out["sizing"] = sizing(rt, fraction)
    if cuda and not out["sizing"]["within"]:
        out["failures"].append("decode rows sized past the memory fraction")
    return finish(out)


def decode_rates(rt: ModelRuntime, batches: list[int], context: int = 512, steps: int = 32) -> dict:
    first = rt.prefill(prompt(context, salt=5))
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    rates = {}
    for b in batches:
        for _timed_run in (False, True):  # warmed at this batch first
            decoder = make_decoder(rt, DecoderConfig(max_batch=b, step_token_budget=b * (context + steps + 8)))
            for i in range(b):
                decoder.submit(f"r{i}", first.state, first.next_token, params)
            sync(rt.device)
            start, made = time.perf_counter(), 0
            while decoder.load:
                made += len(decoder.step())
            sync(rt.device)
        rates[str(b)] = {
            "tok_s": round(made / (time.perf_counter() - start), 1),
            "ms_per_step": round(1e3 * (time.perf_counter() - start) / steps, 3),
        }
    return rates


def sizing(rt: ModelRuntime, fraction: float) -> dict:
    """Decode rows sized with this process held to ``fraction`` of the GPU, against what that fraction leaves."""
    if not rt.device.startswith("cuda"):
        config = sized_for(DecoderConfig(), rt)
        return {"fraction": None, "max_batch": config.max_batch, "within": True}
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(fraction, rt.device)
    total = torch.cuda.get_device_properties(rt.device).total_memory
    left = int(fraction * total) - torch.cuda.memory_reserved(rt.device)
    config = sized_for(DecoderConfig(), rt)
    row = row_bytes(rt)
    rows_bytes = config.max_batch * (row.fixed + row.per_token * 2048)
    return {
        "fraction": fraction,
        "left_gib": round(left / 2**30, 2),
        "sized_from_gib": round(device_memory(rt.device) / 2**30, 2),
        "max_batch": config.max_batch,
        "step_token_budget": config.step_token_budget,
        "row_fixed_bytes": row.fixed,
        "row_bytes_per_token": row.per_token,
        "rows_gib": round(rows_bytes / 2**30, 2),
        "within": rows_bytes <= left,
    }


# -- serve ----------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def serve(model: str, device: str, dtype_name: str, long_tokens: int, short_tokens: int, timeout: float) -> dict:
    check_cuda(device)
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "minifaas.commands.main",
        "serve",
        "--port",
        str(port),
        "--model",
        model,
        "--dtype",
        dtype_name,
        "--prfaas-device",
        device,
        "--pd-device",
        device,
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    # the server's output, read only if it fails (a pipe left unread would block it); closed once it stops
    log = tempfile.TemporaryFile()  # noqa: SIM115
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out: dict = {"model": model, "device": device, "dtype": dtype_name, "failures": []}
    try:
        try:
            health = wait_healthy(f"http://127.0.0.1:{port}", proc, timeout)
        except (RuntimeError, TimeoutError) as e:
            log.seek(0)
            raise RuntimeError(f"{e}: {log.read().decode(errors='replace')[-2000:]}") from None
        out["cold_start_s"] = round(time.perf_counter() - start, 2)
        note(f"serving after {out['cold_start_s']} s")
        out["health"] = health
        served = {}
        for name, n in (("long", long_tokens), ("short", short_tokens)):
            ids = prompt(n, salt=11 + n)
            t0 = time.perf_counter()
            body = post(
                f"http://127.0.0.1:{port}/v1/completions",
                {"model": model, "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
                timeout=120,
            )
            info = body.get("minifaas", {})
            served[name] = {
                "ids": ids,
                "text": body["choices"][0]["text"],
                "route": info.get("route"),
                "ttft_s": info.get("ttft_s"),
                "e2e_s": round(time.perf_counter() - t0, 3),
            }
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        log.close()
    rt = ModelRuntime.load(model, device, dtype=DTYPES[dtype_name])
    for name, row in served.items():
        tokens = generate(rt, row.pop("ids"), SamplingParams(max_tokens=16, ignore_eos=True))
        row["equal_in_process"] = row["text"] == rt.tokenizer.decode(tokens)
        if not row["equal_in_process"]:
            out["failures"].append(f"the {name} request's text differs from the in-process run's")
    out["requests"] = served
    if device.startswith("cuda") and set(out["health"].get("kernels", {}).values()) - {"fla"}:
        out["failures"].append(f"a worker does not run fla: {out['health'].get('kernels')}")
    if served.get("long", {}).get("route") == served.get("short", {}).get("route"):
        out["failures"].append("the long and short prompts took the same route")
    return finish(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=("env", "reference", "kernels", "movement", "scale", "serve"))
    p.add_argument(
        "--model",
        default="kimi-linear-tiny",
        help="a preset, a checkpoint or a family's config file (models/families/*.json); "
        "reference: several, comma-separated",
    )
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--file", default="", help="reference: the folder to save in; kernels: the folder to compare with")
    p.add_argument("--config", default="models/configs/Qwen__Qwen3.5-0.8B.json", help="scale: the model's config")
    p.add_argument("--lengths", default="2048,8192,32768", help="scale: prefill lengths")
    p.add_argument("--stream-tokens", type=int, default=8192, help="scale: the streamed prefill's length")
    p.add_argument("--batches", default="1,16,64", help="scale: decode batches")
    p.add_argument("--fraction", type=float, default=1 / 3, help="scale: the memory fraction decode rows are sized in")
    p.add_argument("--shrink", action="store_true", help="scale: four layers of a narrow width (the dry run)")
    p.add_argument("--long", type=int, default=1500, help="serve: the long prompt's tokens")
    p.add_argument("--short", type=int, default=64, help="serve: the short prompt's tokens")
    a = p.parse_args(argv)
    if a.step in ("reference", "kernels") and not a.file:
        p.error(f"{a.step} needs --file")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    if a.step == "env":
        check_cuda(a.device)
        result = finish(env(a.device))
    elif a.step == "reference":
        result = reference(a.model.split(","), a.tokens, a.file)
    elif a.step == "kernels":
        result = kernels(a.model, a.device, a.dtype, a.file)
    elif a.step == "movement":
        result = movement(a.model, a.device, a.tokens)
    elif a.step == "scale":
        result = scale(a.config, a.device, ints(a.lengths), a.stream_tokens, ints(a.batches), a.fraction, a.shrink)
    else:
        result = serve(a.model, a.device, a.dtype, a.long, a.short, 180)
    print(json.dumps(result, default=str))
    if not result["ok"]:
        sys.exit(f"{a.step} failed: " + "; ".join(result["failures"]))


if __name__ == "__main__":
    main()
