"""Cache moves: under the ABUNDANT rule, a cached prefix brought into the prefill node's cluster before it prefills.

A move that cannot be made is counted, and the prefill computes the prefix itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Protocol

from minifaas.cache.prefix_index import PrefixDirectory, PromptKeys
from minifaas.control.worker_ops import Export, Exported, Failed
from minifaas.gateway.inter_cluster_link import InterClusterLink
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.gateway.worker_handle import WorkerHandle
from minifaas.gateway.workers import Workers
from minifaas.policy.codec_policy import CodecChoice
from minifaas.policy.router import CacheMove

log = logging.getLogger("minifaas.gateway")


class Codecs(Protocol):
    """The codec policy's side of a move (``PrefillDispatch``): the codec to send it in, and what it did."""

    def codec(self) -> CodecChoice: ...

    def coded(self, reply: Exported, nbytes: int) -> None: ...


class CacheMoves:
    def __init__(
        self,
        pool: Workers,
        link: InterClusterLink,
        prefixes: PrefixDirectory,
        metrics: ServeMetrics,
        codecs: Codecs,
        timeout: float,
        transfer_ids: Iterator[int],
    ) -> None:
        self.pool, self.link, self.prefixes, self.metrics = pool, link, prefixes, metrics
        self.codecs, self.timeout, self.transfer_ids = codecs, timeout, transfer_ids
        self.counts: Counter[str] = Counter()  # done, failed, no_source, bytes

    async def carry_out(
        self, request: GenerateRequest, keys: PromptKeys | None, record: RequestRecord, move: CacheMove,
        dst: WorkerHandle,
    ) -> int | None:  # fmt: skip
        """Send the longest cached prefix from the source cluster to ``dst`` across the link.
        Returns the transfer ``dst`` takes it from, or None when no move could be made."""
        rid, transfer = request.request_id, next(self.transfer_ids)
        hits = self.prefixes.node_hits(keys)
        sources = [w for w in self.pool.workers.values() if w.cluster == move.src and w.serving and hits.get(w.name, 0)]
        link = self.link.move_address(dst)
        if not sources or link is None:
            self.counts["no_source"] += 1
            return None
        src = max(sources, key=lambda w: (hits[w.name], w.name))
        inbox = src.open(rid)
        try:
            choice = self.codecs.codec()
            self.metrics.codec_chosen(choice.codec, choice.reason, choice.break_even_bps)
            tokens, length, codec = request.prompt_ids, move.end_tokens, choice.codec
            src.send(Export(req=rid, transfer=transfer, tokens=tokens, length=length, kv=link, codec=codec))
            async with asyncio.timeout(self.timeout):
                reply = await inbox.get()
        except (TimeoutError, RuntimeError) as e:
            reply = Failed(req=rid, transfer=transfer, error=repr(e))
        finally:
            src.close(rid)
        if not isinstance(reply, Exported) or not reply.tokens:
            why = getattr(reply, "error", None)
            log.warning("request %s: cache move %s -> %s failed: %s", rid, src.name, dst.name, why)
            self.counts["failed"] += 1
            return None
        self.counts["done"] += 1
        self.counts["bytes"] += reply.bytes
        self.codecs.coded(reply, reply.bytes)
        self.metrics.add_kv_bytes(f"{src.name}->{dst.name}", reply.bytes, reply.kv_wire_bytes, reply.codec)
        record.events.append(f"cache_move {src.name}->{dst.name} {reply.tokens} tokens")
        return transfer
