"""A decode worker's job: take a request's state off the KV receiver and decode it with the others.

The decoder is stepped on the model thread, one step per round, and the event loop hands the tokens out between
rounds. Only the loop touches the decoder while no step is in flight: an arrival or an abort during a step is
applied when it returns. A request refused by a full waiting queue is answered ``failed`` at once. With ``hold``,
a step waits a multiple of the last one's length while more requests are on their way, so more rows share it.

The node keeps the full-attention KV of every state it receives (``DecodePrefixCache``). Before a prefill starts,
the gateway has it pin the prefix it holds, so only the KV after that prefix crosses the link, while fixed-size
layers always cross whole; ``JoiningReceiver`` joins the two, so the service sees whole layers and whole states.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence

from minifaas.cache.pool import HybridPrefixPool, Lease, PoolConfig
from minifaas.cache.prefix_index import EntryKind, PromptKeys
from minifaas.control.worker_ops import Decode, Done, Failed, Received, ReplyMessage, Token
from minifaas.model.batch_decoder import BatchDecoder, make_decoder
from minifaas.model.decoder import MAX_HOLD_S, DecoderConfig, QueueFull
from minifaas.model.layer_state import LayerState, ModelState, StateKind
from minifaas.model.runtime import ModelRuntime, decode_finish
from minifaas.model.sampling import SamplingParams
from minifaas.transport.incoming import IncomingTransfer
from minifaas.transport.receiver import KVReceiver
from minifaas.worker.prefix_store import Payload, block_payload, join_tokens

Emit = Callable[[ReplyMessage], None]


Arrival = tuple[str, ModelState, int, SamplingParams, int]  # request, state, next token, sampling, transfer
# a test's poison: a request whose context is in [lo, hi) ends the worker as it joins the batch ("lo:hi")
CRASH_AT_CONTEXT = "MINIFAAS_TEST_CRASH_AT_CONTEXT"


class DecodeService:
    def __init__(
        self,
        runtime: ModelRuntime,
        receiver: KVReceiver | JoiningReceiver,  # the receiver alone, or joined onto the node's prefix cache
        state_timeout: float,
        config: DecoderConfig | None = None,
    ) -> None:
        self.runtime, self.receiver, self.state_timeout = runtime, receiver, state_timeout
        self.config = config or DecoderConfig()
        self.decoder = make_decoder(runtime, self.config)
        self.clients: dict[str, tuple[Emit, int]] = {}  # request -> (emit, transfer) while it decodes
        self.first_tokens: dict[str, asyncio.Future[int]] = {}
        self.stepping = False
        self.arrivals: list[Arrival] = []  # came in during a step
        self.aborts: set[str] = set()  # aborted during a step
        self.wakeup = asyncio.Event()
        lo, _, hi = os.environ.get(CRASH_AT_CONTEXT, "0:0").partition(":")
        self.crash_at = range(int(lo), int(hi or lo))  # empty but in the poison request's test

    @property
    def max_batch(self) -> int:
        """Rows per forward, as the decoder was sized."""
        return self.decoder.config.max_batch if isinstance(self.decoder, BatchDecoder) else 1

    @property
    def load(self) -> int:
        return self.decoder.load + len(self.arrivals)

    def _first_token(self, req: str) -> asyncio.Future[int]:
        if req not in self.first_tokens:
            self.first_tokens[req] = asyncio.get_running_loop().create_future()
        return self.first_tokens[req]

    async def decode(self, msg: Decode, emit: Emit) -> None:
        """Wait for the state and the first token, then hand the request to the decoder."""
        req, transfer, sampling = msg.req, msg.transfer, msg.sampling.params()
        incoming = self.receiver.transfer(transfer)
        first = self._first_token(req)
        try:
            async with asyncio.timeout(self.state_timeout or None):  # 0: the gateway's first-token deadline
                state = await incoming.model_state()
            emit(Received(req=req, transfer=transfer, bytes=state.nbytes))
            async with asyncio.timeout(self.state_timeout or None):
                next_token = await first
        except asyncio.CancelledError:  # aborted: the sender's hang-up that follows is no fault of the link
            incoming.abandon()
            raise
        finally:
            if self.first_tokens.get(req) is first:
                del self.first_tokens[req]
        finish = decode_finish(self.runtime, sampling, next_token, 1, state.seq_len)
        if finish is not None:
            emit(Done(req=req, transfer=transfer, finish=finish))
            return
        self.clients[req] = (emit, transfer)
        if self.stepping:
            self.arrivals.append((req, state, next_token, sampling, transfer))
        else:
            self._submit((req, state, next_token, sampling, transfer))
        self.wakeup.set()

    def start(self, req: str, next_token: int) -> None:
        future = self._first_token(req)
        if not future.done():
            future.set_result(next_token)

    def abort(self, req: str) -> None:
        self.clients.pop(req, None)
        future = self.first_tokens.pop(req, None)
        if future is not None and not future.done():
            future.cancel()
        if self.stepping:
            self.aborts.add(req)
        else:
            self.decoder.abort(req)

    def _submit(self, arrival: Arrival) -> None:
        req = arrival[0]
        if arrival[1].seq_len in self.crash_at:
            os._exit(70)  # the poison request's test: the worker dies as this request joins its batch
        try:
            self.decoder.submit(*arrival[:4])
        except (QueueFull, ValueError) as e:  # full, or a bad state: this request fails, the others go on
            emit, transfer = self.clients.pop(req)
            why = f"overloaded: {e}" if isinstance(e, QueueFull) else f"{type(e).__name__}: {e}"
            emit(Failed(req=req, transfer=transfer, error=why))

    def _apply_pending(self) -> None:
        for req in self.aborts:
            self.decoder.abort(req)
        self.aborts.clear()
        arrivals, self.arrivals = self.arrivals, []
        for arrival in arrivals:  # not aborted meanwhile (nor replaced by a later attempt with the request's id)
            if arrival[0] in self.clients and self.clients[arrival[0]][1] == arrival[4]:
                self._submit(arrival)

    async def run(self) -> None:
        while True:
            await self.wakeup.wait()
            if not self.decoder.load:
                self.wakeup.clear()
                continue
            self.stepping, started = True, time.perf_counter()
            tokens = await self.runtime.on_forward_thread(self.decoder.step)
            self.stepping, took = False, time.perf_counter() - started
            self._apply_pending()
            for t in tokens:
                client = self.clients.get(t.request)
                if client is None:  # aborted while its token was being computed
                    continue
                emit, transfer = client
                emit(Token(t.request, transfer, t.token, t.finish))
                if t.finish is not None:
                    del self.clients[t.request]
            if self.config.hold and len(self.first_tokens) > self.decoder.load:  # more on their way than here
                await asyncio.sleep(min(self.config.hold * took, MAX_HOLD_S))


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
        self.pool.touch(keys, keys.num_full_blocks * size)

    def cancel(self, transfer: int) -> None:
        """The transfer ended (delivered, failed or aborted): let its prefix go."""
        self._expected.pop(transfer, None)
        self._prefixes.pop(transfer, None)
        lease = self._leases.pop(transfer, None)
        if lease is not None:
            self.pool.release(lease)


class JoiningReceiver:
    """The decode service's receiver: whole states out, whether or not the prefix crossed the link."""

    def __init__(self, receiver: KVReceiver, cache: DecodePrefixCache, clock: Callable[[], float]) -> None:
        self.receiver, self.cache, self.clock = receiver, cache, clock

    def transfer(self, transfer_id: int) -> JoinedTransfer:
        return JoinedTransfer(self.receiver.transfer(transfer_id), self.cache, self.clock)


class JoinedTransfer:
    def __init__(self, incoming: IncomingTransfer, cache: DecodePrefixCache, clock: Callable[[], float]) -> None:
        self.incoming, self.cache, self.clock = incoming, cache, clock
        self.id = incoming.id

    async def __aiter__(self) -> AsyncIterator[LayerState]:
        layers = []
        try:
            async for layer in self.incoming:
                layers.append(self.cache.join_layer(self.id, layer))
                yield layers[-1]
        except BaseException:
            self.cache.cancel(self.id)
            raise
        self.cache.received(self.id, _whole(layers), self.clock())

    async def model_state(self) -> ModelState:
        return _whole([layer async for layer in self])

    def abandon(self) -> None:
        self.incoming.abandon()


def _whole(layers: list[LayerState]) -> ModelState:
    return ModelState(layers, max((s.seq_len for s in layers), default=0))
