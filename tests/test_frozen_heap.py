"""A ready worker's heap, and the serving gateway's: what each loaded before serving is frozen out of the garbage
collector's full passes."""

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
        gc.collect()  # a full pass, as one that comes while serving
        frozen, scanned = gc.get_freeze_count(), len(gc.get_objects())
        gc.unfreeze()  # what was frozen holds no garbage: start-up's was collected first
        print(json.dumps({"frozen": frozen, "scanned": scanned, "garbage": gc.collect()}))
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
    # the model, torch and transformers are frozen, without garbage; a full pass scans only what came after warm-up
    assert heap["frozen"] > 100_000, heap
    assert heap["scanned"] < heap["frozen"] / 10, heap
    assert heap["garbage"] < 100, heap


# the gateway as `minifaas serve` runs it: once it says it is serving, the heap that start-up made is frozen
GATEWAY = """
import argparse, gc, json, logging, os, signal
from minifaas.commands import serve

class Serving(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("serving "):
            frozen = gc.get_freeze_count()
            gc.unfreeze()
            print(json.dumps({"frozen": frozen, "garbage": gc.collect()}), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # the command's own stop

logging.getLogger("minifaas.serve").addHandler(Serving())
parser = argparse.ArgumentParser()
serve.add_arguments(parser)
serve.run(parser.parse_args(["--model", "kimi-linear-tiny", "--port", "0", "--log-level", "INFO"]))
"""


def test_the_serving_gateway_leaves_what_start_up_loaded_out_of_full_collections() -> None:
    out = subprocess.run([sys.executable, "-c", GATEWAY], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    heap = json.loads(out.stdout.strip().splitlines()[-1])
    assert heap["frozen"] > 100_000 and heap["garbage"] < 100, heap
