"""One request's KV streamed through the link emulator, layer by layer, while prefill is still running.

The receiver listens; a link emulator process (a real TCP relay, here paced to
2 Mbit/s with 20 ms one-way delay) sits in front of it; the sender streams
each layer from prefill's per-layer callback over 4 connections. Per layer it
prints when prefill produced it and when the receiver had all of it: with
pipelining, the transfer of early layers overlaps the forward of later ones,
so the last layer lands soon after prefill ends, not a whole transfer later.

    python examples/kv_over_emulated_link.py
"""

from __future__ import annotations

import asyncio
import time

from minifaas.emulator.emulator_process import EmulatorProcess
from minifaas.emulator.pacer import parse_rate
from minifaas.model.layer_state import LayerState, ModelState
from minifaas.model.runtime import ModelRuntime
from minifaas.model.state_codec import same_state
from minifaas.transport.outgoing import KVSender, SenderConfig
from minifaas.transport.receiver import KVReceiver, ReceiverConfig

SECRET = b"example-link-secret-0123456789ab"
PROMPT = "Layer i travels over the link while layer i+1 is still being computed. "
RATE, DELAY_MS = "2mbit", 20


async def main() -> None:
    runtime = ModelRuntime.load()
    tokens = runtime.tokenizer.encode(PROMPT)
    produced: dict[int, float] = {}
    received: dict[int, float] = {}
    async with (
        KVReceiver(ReceiverConfig(SECRET)) as receiver,
        EmulatorProcess(("127.0.0.1", receiver.port), rate=RATE, delay_ms=DELAY_MS) as link,
        KVSender(SenderConfig("127.0.0.1", link.port, SECRET, connections=4, chunk_bytes=8192)) as sender,
    ):
        incoming = receiver.transfer(1)

        async def receive() -> ModelState:
            layers = []
            async for layer in incoming:
                received[layer.layer] = time.monotonic()
                layers.append(layer)
            return ModelState(layers, len(tokens))

        start = time.monotonic()
        async with asyncio.TaskGroup() as tasks:
            receiving = tasks.create_task(receive())
            async with sender.stream(1, runtime.num_states) as out:

                def on_layer(layer: LayerState) -> None:  # runs in the prefill thread
                    produced[layer.layer] = time.monotonic()
                    out.put_threadsafe(layer)

                result = await asyncio.to_thread(runtime.prefill, tokens, on_layer=on_layer)
        stats = await link.control.stats()

    print(f"{len(tokens)} tokens, {result.state.nbytes} state bytes over a {RATE} link ({DELAY_MS} ms delay)")
    print("layer  kind              bytes   produced   received")
    for state in result.state.layers:
        i = state.layer
        kind = state.kind.name
        print(f"{i:>5}  {kind:<16}{state.nbytes:>7}  {produced[i] - start:>8.3f}s {received[i] - start:>8.3f}s")
    prefill_end, last = produced[runtime.num_states - 1] - start, max(received.values()) - start
    after = stats["up_bytes"] * 8 / (parse_rate(RATE) or float("inf"))
    print(f"prefill ended at {prefill_end:.3f}s and the last layer arrived at {last:.3f}s;")
    print(f"sent only after prefill, the {stats['up_bytes']} bytes would need ~{after:.3f}s more on this link")
    same = same_state(receiving.result(), result.state)
    print(f"received state equals the prefilled state: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    asyncio.run(main())
