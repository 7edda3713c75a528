"""Freed host memory kept for the next forward: a forward stops paying page faults for its activations."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from minifaas.model import host_memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")

FAULTS = """
import json, resource, statistics, torch
from minifaas.model.host_memory import keep_freed_memory
from minifaas.model.runtime import ModelRuntime
torch.set_num_threads(1)
rt = ModelRuntime.load("kimi-linear-tiny")
ids = list(range(128))
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rt.prefill(ids)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# the first two prefills grow the heap; a kept heap still faults a few hundred pages in now and then
print(json.dumps({"kept": keep_freed_memory(), "faults": statistics.median(faults[2:])}))
"""


def faults_per_prefill(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != host_memory.ENV} | env
    done = subprocess.run([sys.executable, "-c", FAULTS], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_loaded_runtime_keeps_freed_memory_and_its_prefills_stop_faulting_pages_in() -> None:
    kept, system = faults_per_prefill(), faults_per_prefill(**{host_memory.ENV: "system"})
    assert kept["kept"] is True and system["kept"] is False
    # glibc's defaults map a 128-token prefill's activations afresh each time: thousands of faults
    assert system["faults"] > 2_000
    assert kept["faults"] < system["faults"] / 10


def test_keeping_freed_memory_is_set_once_per_process() -> None:
    first = host_memory.keep_freed_memory()
    assert host_memory.keep_freed_memory() is first


def test_a_runtime_runs_what_it_is_given_on_one_thread_of_its_own() -> None:
    import asyncio
    import threading

    from minifaas.model.runtime import ModelRuntime

    runtime = ModelRuntime.load("kimi-linear-tiny")

    async def main() -> list[int]:
        forwards = [runtime.on_forward_thread(lambda: (runtime.prefill([1, 2, 3]), threading.get_ident())[1])
                    for _ in range(4)]  # fmt: skip
        return list(await asyncio.gather(*forwards, asyncio.to_thread(threading.get_ident)))

    *forward_threads, pool_thread = asyncio.run(main())
    assert len(set(forward_threads)) == 1
    assert forward_threads[0] not in (threading.get_ident(), pool_thread)
