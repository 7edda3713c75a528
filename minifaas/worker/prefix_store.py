"""A node's prefix cache: the live payloads of a ``HybridPrefixPool``, on a prefill node or a decode node.

Payloads are in host memory. A block holds the full-attention KV of its tokens; a snapshot at length n holds the
KV of the partial block before n, every other layer's state at exactly n, and the logits of the token after n.
On a prefill node (``PrefixStore``) a prefill continues from its hit in segments that end at the pool's snapshot
points (``advance``), the last one streaming (``compute``); a prompt whose end snapshot is held runs no forward.
A decode node (``DecodePrefixCache``) keeps the full-attention KV of every state it receives. Before a prefill
starts the gateway has it pin the prefix it holds, so only the KV after it crosses the link (fixed-size layers
always cross whole); ``receive`` joins the two, so the decode service sees whole states.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from minifaas.cache.pool import HybridPrefixPool, Lease
from minifaas.cache.pool_config import PoolConfig
from minifaas.cache.prefix_index import EntryKind, PromptKeys
from minifaas.model.layer_state import LayerState, ModelState, StateKind
from minifaas.model.runtime import ModelRuntime, PrefillResult
from minifaas.model.sampling import GREEDY, SamplingParams, sample
from minifaas.transport.receiver import IncomingTransfer

Payload = tuple[LayerState, ...]


class LayerSink(Protocol):
    """Where a prefill puts its layers as they become final (``prefill_service.TransferSink``: on the wire)."""

    def put_layer(self, layer: LayerState) -> None: ...

    def put_tokens(self, piece: LayerState, start: int, forward_total: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A snapshot's payload: the states valid at exactly its length, and the logits [vocab] of the token after
    it, so that the same prompt again needs no forward (None: a state moved in from another node)."""

    states: Payload
    logits: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.states) + (self.logits.nbytes if self.logits is not None else 0)


@dataclass(slots=True)
class CachedPrefill:
    """One prompt's cache plan and progress: its keys, the pinned hit, the state reached so far, and what the pool
    keeps of it: cut from the final state by ``cut``, after the result has gone on (the copies are no part of the
    time to the first token)."""

    keys: PromptKeys
    lease: Lease[Payload]
    state: ModelState | None  # after ``done`` tokens: the hit's state at first; None for a cold start
    points: list[int]  # snapshot points inside the prompt: each ends a forward, its state is kept
    snapshot_end: bool  # keep the state at the prompt's end too
    done: int = 0
    snapshots: list[tuple[int, Snapshot]] = field(default_factory=list)  # (length, payload) to keep, the end once cut
    logits: torch.Tensor | None = None  # the whole prompt is the hit: the logits of the token after it
    seconds: float = 0.0  # spent in forwards so far
    blocks: list[tuple[int, Payload]] = field(default_factory=list)  # (block index, payload) to keep, once cut
    cut: bool = False  # the blocks and the end snapshot are in (or nothing is kept)

    @property
    def hit_tokens(self) -> int:
        return self.lease.hit_tokens


class PrefixStore:
    def __init__(self, config: PoolConfig, namespace: str, layout: Sequence[StateKind], node: str) -> None:
        self.pool: HybridPrefixPool[Payload | Snapshot] = HybridPrefixPool(config, node)
        self.namespace, self.layout = namespace, tuple(layout)

    @property
    def enabled(self) -> bool:
        return self.pool.config.enabled

    def begin(self, tokens: Sequence[int], seen_tokens: int = 0) -> CachedPrefill:
        """Pin the usable hit and load its state: the whole prompt where its end snapshot kept the logits, else
        a prefix that leaves at least one token to compute. ``seen_tokens``: the longest prefix of the prompt
        that some node stored (the gateway's directory), a branch point worth a snapshot; this node's own pool
        adds what it holds."""
        size, n = self.pool.config.block_size, len(tokens)
        keys = PromptKeys.from_tokens(tokens, size, self.namespace)
        at_end = self.pool.entry(EntryKind.SNAPSHOT, keys.end_key) if self.enabled else None  # it kept the logits
        logits = at_end.payload.logits if at_end is not None and isinstance(at_end.payload, Snapshot) else None
        lease = self.pool.acquire(keys, limit=n if logits is not None else n - 1)
        try:
            h, prefix = lease.hit_tokens, self.load(lease)
        except BaseException:
            self.pool.release(lease)
            raise
        points = []
        if self.enabled:
            seen = max(seen_tokens, self.pool.match(keys, limit=n - 1).kv_blocks * size)
            points = self.pool.snapshot_points(h, n, seen)
        snapshot_end = bool(points) and points[-1] == n
        points = points[:-1] if snapshot_end else points
        logits = logits if h == n else None
        return CachedPrefill(keys, lease, prefix, points, snapshot_end, h, logits=logits, cut=not self.enabled)

    def advance(
        self, runtime: ModelRuntime, plan: CachedPrefill, sink: LayerSink | None = None, chunk_tokens: int = 0
    ) -> None:
        """Prefill up to the last snapshot point inside the prompt, keeping the state at each. Blocking. With
        ``chunk_tokens`` every forward runs in chunks, its full-attention tokens streaming to ``sink``."""
        tokens = plan.keys.tokens
        assert tokens is not None
        on_tokens = sink.put_tokens if sink is not None and chunk_tokens else None
        for end in plan.points:
            if end <= plan.done:
                continue
            step = runtime.prefill(tokens[plan.done : end], plan.state, chunk_tokens=chunk_tokens, on_tokens=on_tokens)
            plan.state, plan.done, plan.seconds = step.state, end, plan.seconds + step.seconds
            states = snapshot_payload(step.state, self.layout, self.pool.config.block_size)
            plan.snapshots.append((end, Snapshot(states, step.logits)))

    def compute(
        self, runtime: ModelRuntime, plan: CachedPrefill, sink: LayerSink | None = None,
        sampling: SamplingParams = GREEDY, chunk_tokens: int = 0,
    ) -> PrefillResult:  # fmt: skip
        """Prefill the rest of the prompt, streaming it to ``sink``: with ``chunk_tokens``, every forward in token
        chunks; without, the last forward by layer. Blocking: run it in a thread. What the pool keeps of it is
        cut later (``cut``, ``finish``)."""
        if plan.logits is not None:  # held whole: nothing new to keep
            plan.cut = True
            return replayed(runtime, plan, sink, sampling)
        self.advance(runtime, plan, sink, chunk_tokens)
        tokens = plan.keys.tokens
        assert tokens is not None
        on_layer = sink.put_layer if sink is not None else None
        on_tokens = sink.put_tokens if sink is not None and chunk_tokens else None
        result = runtime.prefill(tokens[plan.done :], plan.state, on_layer, sampling, chunk_tokens, on_tokens)
        result.seconds += plan.seconds
        result.computed_tokens = len(tokens) - plan.hit_tokens
        return result

    def cut(self, plan: CachedPrefill, result: PrefillResult) -> None:
        """Copy out of the final state what the pool keeps: the new blocks and the end snapshot. Blocking (on
        a GPU the copies wait for the device): run it in a thread. The pool itself is not touched."""
        if plan.cut:
            return
        size, final = self.pool.config.block_size, result.state
        if plan.snapshot_end:
            end = Snapshot(snapshot_payload(final, self.layout, size), result.logits)
            plan.snapshots.append((plan.keys.num_tokens, end))
        first = plan.hit_tokens // size
        plan.blocks = [(j, block_payload(final, j, size)) for j in range(first, plan.keys.num_full_blocks)]
        plan.cut = True

    def finish(self, plan: CachedPrefill, result: PrefillResult, now: float) -> None:
        """Store the new blocks (in order, so each finds its parent), then the snapshots; unpin the hit. Cuts
        them first where ``cut`` has not (then it blocks as ``cut`` does)."""
        try:
            self.cut(plan, result)
            for j, payload in plan.blocks:
                if not self.pool.put_block(plan.keys, j, now, _nbytes(payload), payload):
                    break  # a later block would be an orphan
            for n, snapshot in plan.snapshots:
                self.pool.put_snapshot(plan.keys, n, now, snapshot.nbytes, snapshot)
            self.pool.touch(plan.keys, plan.keys.num_tokens)
        finally:
            self.release(plan)

    def load(self, lease: Lease[Payload]) -> ModelState | None:
        """The model state after a lease's hit (None: no hit): its blocks' KV joined, then its snapshot's."""
        h, snapshot = lease.hit_tokens, lease.snapshot_payload
        if not h:
            return None
        full = [i for i, kind in enumerate(self.layout) if kind is StateKind.FULL_ATTENTION]
        parts: list[list[LayerState]] = [[] for _ in self.layout]
        for payload in lease.block_payloads:
            assert payload is not None, "a live pool entry without its payload"
            for i, s in zip(full, payload, strict=True):
                parts[i].append(s)
        if isinstance(snapshot, Snapshot):
            for i, s in enumerate(snapshot.states):
                parts[i].append(s)
        layers = [join_tokens(p) if kind is StateKind.FULL_ATTENTION else p[-1] for kind, p in zip(self.layout, parts)]
        for s in layers:
            if s.seq_len != h:
                raise ValueError(f"layer {s.layer}: cached state covers {s.seq_len} tokens, the hit is {h}")
        return ModelState(layers, h)

    def release(self, plan: CachedPrefill) -> None:
        if not plan.lease.released:
            self.pool.release(plan.lease)


def replayed(
    runtime: ModelRuntime, plan: CachedPrefill, sink: LayerSink | None, sampling: SamplingParams
) -> PrefillResult:
    """A prompt held whole: its cached state handed on layer by layer, its first token sampled from the kept
    logits, as the forward that computed them sampled it. No forward runs."""
    start = time.perf_counter()
    assert plan.state is not None and plan.logits is not None
    if sink is not None:
        for layer in plan.state.layers:
            sink.put_layer(layer)
    n = plan.keys.num_tokens
    token = sample(plan.logits, sampling, n, eos_token_id=runtime.eos_token_id)
    return PrefillResult(plan.state, token, plan.logits, 0, time.perf_counter() - start)


def block_payload(state: ModelState, index: int, block_size: int) -> Payload:
    """Block ``index``'s full-attention KV, copied out so the pool does not pin the whole prompt's tensors."""
    start, end = index * block_size, (index + 1) * block_size
    return tuple(_copy(s.slice_tokens(start, end)) for s in state.layers if s.kind is StateKind.FULL_ATTENTION)


def snapshot_payload(state: ModelState, layout: Sequence[StateKind], block_size: int) -> Payload:
    """Everything needed at exactly ``state.seq_len`` that the blocks before it do not hold."""
    n = state.seq_len
    start = n - n % block_size
    out = []
    for s, kind in zip(state.layers, layout, strict=True):
        out.append(_copy(s.slice_tokens(start, n)) if kind is StateKind.FULL_ATTENTION else _copy(s))
    return tuple(out)


def join_tokens(parts: list[LayerState]) -> LayerState:
    """Full-attention KV of consecutive token ranges, in order, as one state."""
    first = parts[0]
    names = [n for n, _ in first.slots]
    slots = tuple((n, torch.cat([p.tensor(n) for p in parts], dim=-2)) for n in names)
    return LayerState(first.layer, first.kind, sum(p.seq_len for p in parts), slots)


def _copy(s: LayerState) -> LayerState:
    """Copied into host memory: the pool's budget (``--cache-mib``) is host memory, and a hit then joins blocks
    computed here with blocks moved in from another cluster without mixing devices. From a GPU the copy waits
    for the device, so it runs in the compute thread, never on the loop."""
    return LayerState(s.layer, s.kind, s.seq_len, tuple((n, t.to("cpu", copy=True)) for n, t in s.slots))


def _nbytes(payload: Payload) -> int:
    return sum(s.nbytes for s in payload)


class DecodePrefixCache:
    def __init__(self, config: PoolConfig, namespace: str, layout: Sequence[StateKind], node: str) -> None:
        self.pool: HybridPrefixPool[Payload] = HybridPrefixPool(config, node)
        self.namespace, self.layout = namespace, tuple(layout)
        self._full = [i for i, kind in enumerate(layout) if kind is StateKind.FULL_ATTENTION]
        self._expected: dict[int, PromptKeys] = {}  # transfer -> the prompt whose state it carries
        self._prefixes: dict[int, dict[int, LayerState]] = {}  # transfer -> layer -> pinned prefix KV
        self._leases: dict[int, Lease[Payload]] = {}

    def pin(self, transfer: int, tokens: Sequence[int], link_start: int) -> int:
        """Expect ``transfer`` to carry ``tokens``' state, pinning the KV of up to ``link_start``
        tokens; returns how many are pinned (the prefill sends the full-attention KV from there)."""
        keys = PromptKeys.from_tokens(tokens, self.pool.config.block_size, self.namespace)
        self._expected[transfer] = keys
        if link_start <= 0:
            return 0
        lease = self.pool.acquire(keys, limit=link_start, kv_only=True)
        self._leases[transfer] = lease
        if lease.hit_tokens:
            by_block = [p for p in lease.block_payloads if p is not None]
            self._prefixes[transfer] = {i: join_tokens([b[k] for b in by_block]) for k, i in enumerate(self._full)}
        return lease.hit_tokens

    async def receive(self, incoming: IncomingTransfer) -> ModelState:
        """``incoming``'s whole state, each layer the pinned prefix KV and then the tokens that crossed; its new
        blocks are kept (failed: its prefix is let go)."""
        try:
            layers = [self.join_layer(incoming.id, layer) async for layer in incoming]
        except BaseException:
            self.cancel(incoming.id)
            raise
        state = ModelState(layers, max((s.seq_len for s in layers), default=0))
        self.received(incoming.id, state, time.perf_counter())
        return state

    def join_layer(self, transfer: int, layer: LayerState) -> LayerState:
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
            if not self.pool.put_block(keys, j, now, _nbytes(payload or ()), payload):
                break
        self.pool.touch(keys, keys.num_full_blocks * size)

    def cancel(self, transfer: int) -> None:
        """The transfer ended (delivered, failed or aborted): let its prefix go."""
        self._expected.pop(transfer, None)
        self._prefixes.pop(transfer, None)
        lease = self._leases.pop(transfer, None)
        if lease is not None:
            self.pool.release(lease)
