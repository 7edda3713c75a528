"""A prefill node's end of a cache move: a cached prefix sent to another cluster's node (``export``), or taken in
before a prefill (``take_in``). A move that does not arrive is counted, and the prefill computes the prefix itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from minifaas.cache.prefix_index import PromptKeys
from minifaas.codec.codec import Codec
from minifaas.control.worker_ops import Export, Exported
from minifaas.model.layer_state import ModelState
from minifaas.net.errors import TransferError
from minifaas.transport.outgoing import KVSender
from minifaas.transport.receiver import KVReceiver
from minifaas.worker.prefix_store import PrefixStore, Snapshot, block_payload, snapshot_payload

log = logging.getLogger("minifaas.prefill")
MOVE_TIMEOUT_S = 30.0  # how long a prompt waits for the cache move that goes ahead of it


async def export(store: PrefixStore, sender: Callable[[str, int], KVSender], msg: Export, codec: Codec) -> Exported:
    """Send the usable prefix of ``msg.tokens`` up to ``msg.length`` (pinned until it is sent) to ``msg.kv``."""
    keys = PromptKeys.from_tokens(msg.tokens, store.pool.config.block_size, store.namespace)
    lease = store.pool.acquire(keys, limit=msg.length)
    try:
        state = store.load(lease)
        report = await sender(*msg.kv).send(msg.transfer, state, codec) if state is not None else None
    finally:
        store.pool.release(lease)
    if state is None or report is None:  # nothing held: nothing sent
        return Exported(req=msg.req, tokens=lease.hit_tokens, bytes=0)
    return Exported(
        req=msg.req,
        tokens=lease.hit_tokens,
        bytes=state.nbytes,
        codec=report.codec,
        kv_wire_bytes=report.wire_bytes,
        kv_encode_s=report.encode_s,
        kv_decode_s=report.decode_s,
    )


async def take_in(store: PrefixStore, receiver: KVReceiver | None, tokens: list[int], transfer: int) -> None:
    """Wait for the prefix state ``transfer`` brings (None ``receiver``: this node accepts none) and keep it."""
    if receiver is None:
        store.pool.counts["moves_refused"] += 1
        return
    try:
        async with asyncio.timeout(MOVE_TIMEOUT_S):
            state = await receiver.transfer(transfer).model_state()
    except (TransferError, TimeoutError) as e:
        log.warning("cache move %d did not arrive (%s): prefilling without it", transfer, e)
        store.pool.counts["moves_lost"] += 1
        return
    import_state(store, tokens, state, time.perf_counter())
    store.pool.counts["moves_imported"] += 1


def import_state(store: PrefixStore, tokens: Sequence[int], state: ModelState, now: float) -> None:
    """Keep a prefix state moved in from another cluster: its blocks, and its snapshot at exactly its length."""
    size, n = store.pool.config.block_size, state.seq_len
    keys = PromptKeys.from_tokens(tokens[:n], size, store.namespace)
    for j in range(keys.num_full_blocks):
        payload = block_payload(state, j, size)
        if not store.pool.put_block(keys, j, now, sum(s.nbytes for s in payload), payload):
            return
    snapshot = Snapshot(snapshot_payload(state, store.layout, size))
    store.pool.put_snapshot(keys, n, now, snapshot.nbytes, snapshot)
