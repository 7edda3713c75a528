"""The workers a configuration asks for, and the command line each role is started with.

A cluster lists hand-started workers (dialled, never started) or counts of workers its launcher starts. A local
worker on ``cuda:N`` sees that GPU alone (``CUDA_VISIBLE_DEVICES``) and is told ``--device cuda:0``.
"""

from __future__ import annotations

import json
import os

from minifaas.config import NAME_PREFIX, ServeConfig
from minifaas.launch.launcher import WorkerSpec
from minifaas.net.address import parse_address


def worker_argv(c: ServeConfig, role: str, cluster: str, device: str | None = None) -> tuple[str, ...]:
    """The flags of a worker the gateway starts (``--role``, ``--name`` and addresses come from its launcher)."""
    device = device or c.cluster(cluster).device
    fraction = c.memory_fraction(cluster, device)
    if _sees_one_gpu(c, device):
        device = "cuda:0"  # the one GPU its CUDA_VISIBLE_DEVICES shows it
    argv = ["--model", c.model, "--seed", str(c.seed), "--connections", str(c.link.connections), "--device", device]
    if fraction:
        argv += ["--gpu-memory-fraction", f"{fraction:.4g}"]
    argv += ["--kv-compression", c.link.worker_codecs]
    argv += ["--dtype", c.worker_dtype(cluster)] + (["--trust-remote-code"] if c.trust_remote_code else [])
    argv += ["--threads", str(c.worker_threads(cluster, role)), "--log-level", c.worker_log_level]
    if c.allow_slow_kernels:
        argv.append("--allow-slow-kernels")
    if not c.link.pipelined:
        argv.append("--no-pipelining")
    argv += ["--cache-block-size", str(c.cache.block_size), "--cache-mib", str(c.cache.capacity_mib)]
    argv += ["--snapshot-policy", c.cache.snapshot_policy, "--snapshot-interval", str(c.cache.snapshot_interval_blocks)]
    for key, value in c.cache.snapshot_policy_args:  # KEY=VALUE, the value as JSON (arguments.policy_arg)
        argv += ["--snapshot-policy-arg", f"{key}={json.dumps(value)}"]
    if role == "prefill":
        chunk, batch = c.cluster(cluster).prefill_chunk, c.cluster(cluster).prefill_batch
        argv += ["--prefix-cache", c.cache.mode, "--prefill-chunk", str(chunk), "--prefill-batch", str(batch)]
        if c.cache.moves:
            argv.append("--accept-moves")
    else:  # a decode node keeps the KV it receives only to take increments later
        keep = c.cache.enabled and c.cache.incremental_transfer
        argv += ["--prefix-cache", "hybrid" if keep else "none", "--max-batch", str(c.pd.max_batch)]
    return tuple(argv)


def worker_spec(c: ServeConfig, name: str, role: str, cluster: str, device: str | None = None) -> WorkerSpec:
    """The worker ``name`` on ``device`` (None: its cluster's first)."""
    device = device or c.cluster(cluster).device
    gpus = c.ray.gpus_per_worker if device.startswith("cuda") else 0.0
    env = (("CUDA_VISIBLE_DEVICES", visible_gpu(device)),) if _sees_one_gpu(c, device) else ()
    return WorkerSpec(name, role, cluster, worker_argv(c, role, cluster, device), gpus=gpus, device=device, env=env)


def _sees_one_gpu(c: ServeConfig, device: str) -> bool:
    """A local worker on a GPU is shown that one alone; a Ray actor's GPUs are Ray's to show."""
    return device.startswith("cuda") and c.launcher == "local"


def visible_gpu(device: str, environ: dict[str, str] | None = None) -> str:
    """What CUDA_VISIBLE_DEVICES shows a worker on ``device``: that one GPU of those the gateway sees."""
    index = int(device.partition(":")[2] or 0)
    seen = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if seen is None:
        return str(index)
    listed = [d.strip() for d in seen.split(",") if d.strip()]
    if index >= len(listed):
        raise ValueError(f"no {device}: CUDA_VISIBLE_DEVICES={seen!r} shows {len(listed)} GPU(s)")
    return listed[index]


def planned_specs(c: ServeConfig) -> list[WorkerSpec]:
    """Every worker the configuration asks for, not started yet, each on its device."""
    specs = []
    for cluster, cc in (("prfaas", c.prfaas), ("pd", c.pd)):
        if cc.workers:
            specs += [WorkerSpec("", "", cluster, address=parse_address(a)) for a in cc.workers]
            continue
        specs += [
            worker_spec(c, f"{NAME_PREFIX[cluster, role]}{i}", role, cluster, device)
            for role, i, device in cc.placement()
        ]
    return specs
