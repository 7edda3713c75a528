"""A prefill worker's job: run prompts through the model and stream each layer's state as it is made.

One forward runs at a time (prefill is compute-bound; a second one would only
halve both), and waiting prompts take their turn in arrival order. The lock is
held for the compute only: while the tail of one request's state is still on
the wire, the next prompt is already running.
"""

from __future__ import annotations

import asyncio
import time

from minifaas.model.runtime import ModelRuntime
from minifaas.serve.control import sampling_from_json
from minifaas.transport import KVSender, SenderConfig


class PrefillService:
    def __init__(self, runtime: ModelRuntime, secret: bytes, connections: int, pipelined: bool) -> None:
        self.runtime, self.secret = runtime, secret
        self.connections, self.pipelined = connections, pipelined
        self.senders: dict[tuple[str, int], KVSender] = {}
        self.compute = asyncio.Lock()
        self.queued_tokens = 0

    def sender(self, host: str, port: int) -> KVSender:
        key = (host, port)
        if key not in self.senders:
            config = SenderConfig(host, port, self.secret, connections=self.connections, pipelined=self.pipelined)
            self.senders[key] = KVSender(config)
        return self.senders[key]

    async def prefill(self, msg: dict) -> dict:
        tokens: list[int] = msg["tokens"]
        sampling = sampling_from_json(msg["sampling"])
        sender = self.sender(*msg["kv"])
        arrived = time.perf_counter()
        self.queued_tokens += len(tokens)
        await self.compute.acquire()
        held = True
        try:
            started = time.perf_counter()
            async with sender.stream(msg["transfer"], layers=self.runtime.num_layers) as tx:
                try:
                    result = await asyncio.to_thread(self.runtime.prefill, tokens, None, tx.put_threadsafe, sampling)
                finally:
                    self.compute.release()
                    held = False
                    self.queued_tokens -= len(tokens)
                computed = time.perf_counter()
            finished = time.perf_counter()
        finally:
            if held:
                self.compute.release()
                self.queued_tokens -= len(tokens)
        return {
            "op": "prefilled",
            "req": msg["req"],
            "next_token": result.next_token,
            "kv_bytes": result.state.nbytes,
            "queue_s": started - arrived,
            "prefill_s": result.seconds,
            "transfer_tail_s": finished - computed,
        }

    async def close(self) -> None:
        for sender in self.senders.values():
            await sender.__aexit__(None, None, None)
