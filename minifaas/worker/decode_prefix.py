"""A decode node's prefix cache: the full-attention KV it received, so a later turn ships only its increment.

The node keeps the full blocks of every state it receives in a kv-only ``HybridPrefixPool``. Before a prefill
starts, the gateway has the node pin the prefix it holds (``pin``), so no eviction can leave a hole in the joined
state; only the KV after that prefix crosses the link, while fixed-size layers always cross whole.
``JoiningReceiver`` joins the two, so the decode service sees whole layers and whole states.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from minifaas.cache.block_hash import PromptKeys
from minifaas.cache.pool import HybridPrefixPool, Lease, PoolConfig
from minifaas.cache.prefix_index import CacheEvent, EntryKind
from minifaas.model.layer_state import LayerState, ModelState, StateKind
from minifaas.transport.incoming import IncomingTransfer
from minifaas.transport.receiver import KVReceiver
from minifaas.worker.prefix_store import Payload, block_payload, join_tokens


class DecodePrefixCache:
    def __init__(self, config: PoolConfig, namespace: str, layout: Sequence[StateKind], node: str) -> None:
        self.pool: HybridPrefixPool[Payload] = HybridPrefixPool(config, node)
        self.namespace, self.layout = namespace, tuple(layout)
        self._full = [i for i, kind in enumerate(layout) if kind is StateKind.FULL_ATTENTION]
        self._expected: dict[int, PromptKeys] = {}  # transfer -> the prompt whose state it carries
        self._prefixes: dict[int, dict[int, LayerState]] = {}  # transfer -> layer -> pinned prefix KV
        self._leases: dict[int, Lease[Payload]] = {}

    def pin(self, transfer: int, tokens: Sequence[int], link_start: int, now: float) -> int:
        """Expect ``transfer`` to carry ``tokens``' state, pinning the KV of up to ``link_start``
        tokens; returns how many are pinned (the prefill sends the full-attention KV from there)."""
        keys = PromptKeys.from_tokens(tokens, self.pool.config.block_size, self.namespace)
        self._expected[transfer] = keys
        if link_start <= 0:
            return 0
        lease = self.pool.acquire(keys, now, limit=link_start, kv_only=True)
        self._leases[transfer] = lease
        if lease.hit_tokens:
            by_block = [p for p in lease.block_payloads if p is not None]
            self._prefixes[transfer] = {i: join_tokens([b[k] for b in by_block]) for k, i in enumerate(self._full)}
        return lease.hit_tokens

    def join_layer(self, transfer: int, layer: LayerState) -> LayerState:
        """A received layer made whole: the pinned prefix KV, then the tokens that crossed."""
        prefix = self._prefixes.get(transfer, {}).get(layer.layer)
        return layer if prefix is None else join_tokens([prefix, layer])

    def received(self, transfer: int, state: ModelState, now: float) -> None:
        """The whole state is here: keep its new blocks, unpin the prefix."""
        keys = self._expected.pop(transfer, None)
        self.cancel(transfer)
        if keys is None or not self.pool.config.enabled:
            return
        size = keys.block_size
        for j, key in enumerate(keys.block_keys):
            entry = self.pool.entry(EntryKind.BLOCK, key)
            payload = entry.payload if entry is not None else block_payload(state, j, size)
            if not self.pool.put_block(keys, j, now, sum(s.nbytes for s in payload or ()), payload):
                break
        self.pool.touch(keys, keys.num_full_blocks * size, now)

    def cancel(self, transfer: int) -> None:
        """The transfer ended (delivered, failed or aborted): let its prefix go."""
        self._expected.pop(transfer, None)
        self._prefixes.pop(transfer, None)
        lease = self._leases.pop(transfer, None)
        if lease is not None:
            self.pool.release(lease)

    def drain_events(self) -> list[CacheEvent]:
        return self.pool.drain_events()


class JoiningReceiver:
    """The decode service's receiver: whole states out, whether or not the prefix crossed the link."""

    def __init__(self, receiver: KVReceiver, cache: DecodePrefixCache, clock: Callable[[], float]) -> None:
        self.receiver, self.cache, self.clock = receiver, cache, clock

    @property
    def port(self) -> int:
        return self.receiver.port

    def transfer(self, transfer_id: int) -> JoinedTransfer:
        return JoinedTransfer(self.receiver.transfer(transfer_id), self)


class JoinedTransfer:
    def __init__(self, incoming: IncomingTransfer, owner: JoiningReceiver) -> None:
        self.incoming, self.owner = incoming, owner
        self.id = incoming.id

    def __aiter__(self) -> AsyncIterator[LayerState]:
        return self._layers()

    async def _layers(self) -> AsyncIterator[LayerState]:
        cache, layers = self.owner.cache, []
        try:
            async for layer in self.incoming:
                layers.append(cache.join_layer(self.id, layer))
                yield layers[-1]
        except BaseException:
            cache.cancel(self.id)
            raise
        cache.received(self.id, _whole(layers), self.owner.clock())

    async def model_state(self) -> ModelState:
        return _whole([layer async for layer in self])


def _whole(layers: list[LayerState]) -> ModelState:
    return ModelState(layers, max((s.seq_len for s in layers), default=0))
