"""Device-to-host staging on the CPU: today's path unchanged, the pumps wait off the loop, no device
tensor reaches the byte codec, and the prefix pool keeps host tensors (a hit that mixes moved-in and
computed blocks works). The same code with a real CUDA event is tests/test_gpu.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from synthetic import synthetic_state

from minifaas.cache.pool_config import PoolConfig
from minifaas.model.host_copy import HostCopier, to_device
from minifaas.model.interleaved_decoder import DecodeStream
from minifaas.model.layer_state import LayerState, ModelState, StateKind, tensor_bytes
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.model.state_codec import same_state
from minifaas.transport.outgoing import KVSender, SenderConfig
from minifaas.transport.receiver import KVReceiver, ReceiverConfig
from minifaas.transport.wire import split_chunks
from minifaas.worker.prefix_moves import import_state
from minifaas.worker.prefix_store import PrefixStore

SECRET = b"cluster-secret-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


def test_on_the_cpu_staging_hands_the_state_back_as_it_is() -> None:
    state = synthetic_state(layers=2, tokens=8, width=4).layers[0]
    copier = HostCopier("cpu")
    host, ready = copier.stage(state)
    assert host is state and ready is None and copier.stream is None
    moved = to_device(state, "cpu")  # a copy, as the cache needs its own tensors
    assert torch.equal(moved.slots[0][1], state.slots[0][1])
    assert moved.slots[0][1].data_ptr() != state.slots[0][1].data_ptr()


def test_a_device_tensor_never_reaches_the_byte_codec() -> None:
    """What would run on the event loop (cutting chunks) refuses a device tensor instead of copying it there."""
    meta = LayerState(0, StateKind.LINEAR_ATTENTION, 4, (("recurrent.0", torch.empty(2, 3, device="meta")),))
    with pytest.raises(ValueError, match="stage it to host memory first"):
        tensor_bytes(meta.slots[0][1])
    with pytest.raises(ValueError, match="stage it to host memory first"):
        split_chunks(meta, 1024)


class _SlowCopy:
    """A copy still under way: the shape of a torch.cuda.Event, finished by another thread."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited_on: list[str] = []

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.waited_on.append(threading.current_thread().name)
        self.done.wait(10)


def test_a_pump_waits_for_the_copy_in_a_thread_and_sends_the_bytes_it_filled() -> None:
    """The host buffers are filled only after the layer was queued: the receiver must get the filled
    bytes, and the loop must keep running while the pump waits."""
    state = synthetic_state(layers=3, tokens=32, width=8)
    empty = [LayerState(s.layer, s.kind, s.seq_len, tuple((n, torch.zeros_like(t)) for n, t in s.slots))
             for s in state.layers]  # fmt: skip
    copy = _SlowCopy()

    async def main() -> None:
        async with KVReceiver(ReceiverConfig(SECRET)) as rx:
            config = SenderConfig("127.0.0.1", rx.port, SECRET, chunk_bytes=1024, connections=2)
            async with KVSender(config) as tx:
                ticks = 0
                async with tx.stream(4, len(state.layers)) as out:
                    for layer in empty:
                        out.put(layer, ready=copy)
                    for _ in range(20):  # the loop goes on while the pumps wait
                        await asyncio.sleep(0.005)
                        ticks += 1
                    assert out.sent_bytes == 0
                    for layer, filled in zip(empty, state.layers):  # the "device" finishes its copies
                        for (_, dst), (_, src) in zip(layer.slots, filled.slots):
                            dst.copy_(src)
                    copy.done.set()
                assert ticks == 20 and out.copy_wait_s > 0
            assert same_state(await rx.transfer(4).model_state(), state)

    asyncio.run(asyncio.wait_for(main(), 30))
    assert copy.waited_on and threading.main_thread().name not in copy.waited_on


def test_the_prefix_pool_keeps_host_copies_and_a_hit_joins_moved_in_and_computed_blocks() -> None:
    rt = ModelRuntime.load("qwen3-tiny")  # dense: every block of a hit is joined along tokens
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    store = PrefixStore(PoolConfig("n", 1 << 28, 16, 2, False), "qwen3-tiny", rt.layout.kinds, "n")
    tokens = [(31 * i + 7) % 256 for i in range(80)]
    moved = rt.prefill(tokens[:32]).state  # as a cache move brings it in: received into host memory
    import_state(store, tokens, ModelState([to_device(s, "cpu") for s in moved.layers], moved.seq_len), now=0.0)
    plan = store.begin(tokens[:64])  # blocks 0-1 moved in; 2-3 computed here
    computed = store.compute(rt, plan, sampling=params)
    store.finish(plan, computed, now=0.0)
    cache_tensors = {t.untyped_storage().data_ptr() for s in computed.state.layers for _, t in s.slots}
    for _, payload in plan.blocks:
        for s in payload:
            for _, t in s.slots:
                assert t.device.type == "cpu" and t.untyped_storage().data_ptr() not in cache_tensors
    plan = store.begin(tokens)
    assert plan.hit_tokens == 64  # two moved-in blocks beside two computed ones
    result = store.compute(rt, plan, sampling=params)
    store.release(plan)
    assert DecodeStream(rt, result.state, result.next_token, params).run() == reference_tokens(rt, tokens, params)
