"""A ready worker's heap: what it loaded before serving is frozen out of the garbage collector's full passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# a real worker in a fresh interpreter: its announce line reports what the collector holds once it is ready
WORKER = """
import asyncio, gc, json
from minifaas.commands.worker import parse_args
from minifaas.worker.worker_process import serve

async def main():
    stop = asyncio.Event()
    def announce(ready):
        collected = gc.collect()  # a full pass, as one that comes while serving
        print(json.dumps({"frozen": gc.get_freeze_count(), "scanned": len(gc.get_objects()), "free": collected}))
        stop.set()
    await serve(parse_args(["--role", "ROLE", "--cluster", "pd", "--model", "kimi-linear-tiny"]), announce, stop)

asyncio.run(main())
"""


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_ready_worker_leaves_what_it_loaded_out_of_full_collections(role: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", WORKER.replace("ROLE", role)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "MINIFAAS_SECRET": "a-heap-test-secret-of-32-bytes!!"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    heap = json.loads(out.stdout.strip().splitlines()[-1])
    # the model, torch and transformers are frozen; a full pass scans only what came after warm-up
    assert heap["frozen"] > 100_000, heap
    assert heap["scanned"] < heap["frozen"] / 10, heap
