"""A prefill worker's job: run prompts through the model and stream each layer's state as it is made.

One forward runs at a time (prefill is compute-bound; a second one would only
halve both), and waiting prompts take their turn in arrival order. The lock is
held for the compute only: while the tail of one request's state is still on
the wire, the next prompt is already running.

With a prefix store, a prompt loads the usable hit from the node's pool when
its turn comes (so it sees everything the prompts before it stored), computes
only the rest, and stores its blocks and snapshots before the next prompt's
turn. The worker tells the gateway of the pool's store/evict events.

Cache moves across the link (the ABUNDANT rule): ``export`` sends a prefix
state from this node's pool to a node of the other cluster, whose ``prefill``
first takes it off its receiver (``import``) and keeps it in its pool, where the
prompt's turn then finds it like any other hit. A move that fails is logged and
counted, and the prompt is prefilled without it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from minifaas.model.layer_state import LayerState, StateKind
from minifaas.model.runtime import ModelRuntime, OnLayer
from minifaas.serve.control import sampling_from_json
from minifaas.serve.prefix_store import PrefixStore
from minifaas.transport import KVReceiver, KVSender, SenderConfig, TransferError

log = logging.getLogger("minifaas.prefill")


class PrefillService:
    def __init__(
        self,
        runtime: ModelRuntime,
        secret: bytes,
        connections: int,
        pipelined: bool,
        store: PrefixStore,
        receiver: KVReceiver | None = None,  # takes cache moves in; None: this node accepts none
        import_timeout: float = 30.0,
    ) -> None:
        self.runtime, self.secret, self.store = runtime, secret, store
        self.receiver, self.import_timeout = receiver, import_timeout
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
        if "import" in msg:
            await self._import(tokens, msg["import"])
        self.queued_tokens += len(tokens)
        await self.compute.acquire()
        held = True
        try:
            started = time.perf_counter()
            plan = self.store.begin(tokens, started)
            try:
                await asyncio.to_thread(self.store.advance, self.runtime, plan)  # the snapshot segments
                async with sender.stream(msg["transfer"], layers=self.runtime.num_layers) as tx:
                    forward = _LayerForwarder(tx.put_threadsafe, msg.get("link_start", 0))
                    try:
                        computed = await asyncio.to_thread(self.store.compute, self.runtime, plan, forward, sampling)
                        self.store.finish(plan, computed, time.perf_counter())
                    finally:
                        self.compute.release()
                        held = False
                        self.queued_tokens -= len(tokens)
                    computed_at = time.perf_counter()
                finished = time.perf_counter()
            finally:
                self.store.release(plan)
        finally:
            if held:
                self.compute.release()
                self.queued_tokens -= len(tokens)
        result = computed.result
        return {
            "op": "prefilled",
            "req": msg["req"],
            "next_token": result.next_token,
            "kv_bytes": forward.nbytes,
            "cached_tokens": plan.hit_tokens,
            "computed_tokens": result.computed_tokens,
            "queue_s": started - arrived,
            "prefill_s": result.seconds,
            "transfer_tail_s": finished - computed_at,
        }

    async def _import(self, tokens: list[int], transfer: int) -> None:
        if self.receiver is None:
            self.store.pool.counts["moves_refused"] += 1
            return
        try:
            async with asyncio.timeout(self.import_timeout):
                state = await self.receiver.transfer(transfer).model_state()
        except (TransferError, TimeoutError) as e:
            log.warning("cache move %d did not arrive (%s): prefilling without it", transfer, e)
            self.store.pool.counts["moves_lost"] += 1
            return
        self.store.import_state(tokens, state, time.perf_counter())
        self.store.pool.counts["moves_imported"] += 1

    async def export(self, msg: dict) -> dict:
        """Send the usable prefix of ``tokens`` up to ``length`` to another cluster's node."""
        lease, state = self.store.export_state(msg["tokens"], msg["length"], time.perf_counter())
        try:
            if state is not None:
                async with self.sender(*msg["kv"]).stream(msg["transfer"], layers=len(state.layers)) as tx:
                    for layer in state.layers:
                        tx.put(layer)
        finally:
            self.store.pool.release(lease)
        nbytes = state.nbytes if state is not None else 0
        return {"op": "exported", "req": msg["req"], "tokens": lease.hit_tokens, "bytes": nbytes}

    async def close(self) -> None:
        for sender in self.senders.values():
            await sender.__aexit__(None, None, None)


class _LayerForwarder:
    """Puts each finished layer on the wire; full-attention KV only from ``link_start`` on, since the
    decode node already holds the tokens before it (incremental transfer)."""

    def __init__(self, put: OnLayer, link_start: int) -> None:
        self.put, self.link_start, self.nbytes = put, link_start, 0

    def __call__(self, layer: LayerState) -> None:
        if self.link_start and layer.kind is StateKind.FULL_ATTENTION:
            layer = layer.slice_tokens(self.link_start, layer.seq_len)
        self.nbytes += layer.nbytes
        self.put(layer)
