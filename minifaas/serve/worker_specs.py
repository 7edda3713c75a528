"""The workers a configuration asks for, and the command line each role is started with.

A cluster either lists hand-started workers (``workers = ["host:port", ...]``:
they are dialled, never started) or has counts of workers the gateway's
launcher starts (local children or Ray actors), named ``prfaas-p<i>``,
``pd-p<i>`` and ``pd-d<i>``.
"""

from __future__ import annotations

from minifaas.serve.config import ServeConfig
from minifaas.serve.launch.launcher import NAME_PREFIX, WorkerSpec, parse_address


def worker_argv(c: ServeConfig, role: str, cluster: str) -> tuple[str, ...]:
    """The flags of a worker the gateway starts (``--role``, ``--name`` and addresses come from its launcher)."""
    device = c.cluster(cluster).device
    argv = ["--model", c.model, "--seed", str(c.seed), "--connections", str(c.link.connections), "--device", device]
    argv += ["--kv-compression", c.link.kv_compression]
    argv += ["--dtype", c.worker_dtype(cluster)] + (["--trust-remote-code"] if c.trust_remote_code else [])
    argv += ["--threads", str(c.worker_threads(cluster))]
    if c.allow_slow_kernels:
        argv.append("--allow-slow-kernels")
    if not c.link.pipelined:
        argv.append("--no-pipelining")
    argv += ["--cache-block-size", str(c.cache.block_size), "--cache-mib", str(c.cache.capacity_mib)]
    argv += ["--snapshot-policy", c.cache.snapshot_policy, "--snapshot-interval", str(c.cache.snapshot_interval_blocks)]
    if role == "prefill":
        chunk = c.cluster(cluster).prefill_chunk
        argv += ["--prefix-cache", c.cache.mode, "--prefill-chunk", str(chunk)]
        if c.cache.moves:
            argv.append("--accept-moves")
    else:  # a decode node keeps the KV it receives only to take increments later
        keep = c.cache.enabled and c.cache.incremental_transfer
        argv += ["--prefix-cache", "hybrid" if keep else "none", "--max-batch", str(c.pd.max_batch)]
    return tuple(argv)


def worker_spec(c: ServeConfig, name: str, role: str, cluster: str) -> WorkerSpec:
    device = c.cluster(cluster).device
    gpus = c.ray.gpus_per_worker if device.startswith("cuda") else 0.0
    return WorkerSpec(name, role, cluster, worker_argv(c, role, cluster), gpus=gpus)


def planned_specs(c: ServeConfig) -> list[WorkerSpec]:
    """Every worker the configuration asks for, not started yet."""
    specs = []
    for cluster, cc in (("prfaas", c.prfaas), ("pd", c.pd)):
        if cc.workers:
            specs += [WorkerSpec("", "", cluster, address=parse_address(a)) for a in cc.workers]
            continue
        for role, count in (("prefill", cc.prefill_workers), ("decode", cc.decode_workers)):
            specs += [worker_spec(c, f"{NAME_PREFIX[cluster, role]}{i}", role, cluster) for i in range(count)]
    return specs
