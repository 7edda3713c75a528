"""The prefill process of the family tests: one PrefillService per model family, driven over stdin.

Usage: python family_child.py SECRET_HEX, then one JSON line per command on stdin, one reply line each:

    {"op": "load", "family": NAME}            -> {"op": "loaded", "digest": sha256 of the weights}
    {"op": "prefill", ...PrefillService msg}  -> the service's reply ({"op": "prefilled", ...})

Each family's model is built once (seeded, as the test process builds it) and
gets a prefix store of its own; prompts stream to the test's KVReceiver through
the real KVSender, in token chunks, from the ``link_start`` the test asks for.
One process serves every family: a Python that imports torch and transformers
costs seconds of CPU before it builds anything.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import msgspec
from weights import weights_digest

from minifaas.cache.pool_config import PoolConfig
from minifaas.control.worker_ops import OPS, from_wire
from minifaas.model.loader import MODELS_DIR, ModelSpec, load_model
from minifaas.model.runtime import ModelRuntime
from minifaas.model.state_layout import needs_snapshot
from minifaas.model.tokenizer import ByteTokenizer
from minifaas.worker.prefill_service import PrefillService
from minifaas.worker.prefix_store import PrefixStore

FAMILIES = MODELS_DIR / "families"
BLOCK, SNAPSHOT_EVERY, CHUNK = 16, 2, 16  # a snapshot every 32 tokens; prefill in forwards of 16


def family_runtime(name: str) -> ModelRuntime:
    """The tiny random model of one family (models/families/NAME.json), seeded like a preset."""
    spec = ModelSpec(name, "preset", Path(FAMILIES / f"{name}.json"))
    return ModelRuntime(load_model(spec), ByteTokenizer(), spec, "cpu")


def family_service(runtime: ModelRuntime, secret: bytes) -> PrefillService:
    kinds = runtime.layout.kinds
    pool = PoolConfig("p", 1 << 30, BLOCK, SNAPSHOT_EVERY, needs_snapshot(kinds))
    store = PrefixStore(pool, runtime.spec.name, kinds, "p")
    return PrefillService(runtime, secret, 2, True, store, chunk_tokens=CHUNK)


async def main(secret: bytes) -> None:
    service: PrefillService | None = None
    while line := await asyncio.to_thread(sys.stdin.readline):
        msg = json.loads(line)
        if msg["op"] == "load":
            if service is not None:
                await service.close()
            runtime = family_runtime(msg["family"])
            service = family_service(runtime, secret)
            reply = {"op": "loaded", "digest": weights_digest(runtime.model)}
        else:
            assert service is not None, "load a family first"
            reply = msgspec.to_builtins(await service.prefill(from_wire(msg, OPS)))
        print(json.dumps(reply), flush=True)
    if service is not None:
        await service.close()


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    asyncio.run(main(bytes.fromhex(sys.argv[1])))
