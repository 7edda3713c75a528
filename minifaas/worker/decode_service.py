"""A decode worker's job: take a request's state off the KV receiver and decode it with the others.

The decoder is stepped on the model thread, one step per round, and the event loop hands the tokens out between
rounds. Only the loop touches the decoder while no step is in flight: an arrival or an abort during a step is
applied when it returns. A request refused by a full waiting queue is answered ``failed`` at once. With ``hold``,
a step waits a multiple of the last one's length while more requests are on their way, so more rows share it.
A state that crossed the link after a pinned prefix is joined onto it (``DecodePrefixCache.receive``): the
service sees whole states.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from minifaas.control.worker_ops import Decode, Done, Failed, Received, ReplyMessage, Token
from minifaas.model.batch_decoder import BatchDecoder, make_decoder
from minifaas.model.decoder import MAX_HOLD_S, DecoderConfig, QueueFull
from minifaas.model.layer_state import ModelState
from minifaas.model.runtime import ModelRuntime, decode_finish
from minifaas.model.sampling import SamplingParams
from minifaas.transport.receiver import KVReceiver
from minifaas.worker.prefix_store import DecodePrefixCache

Emit = Callable[[ReplyMessage], None]
Arrival = tuple[str, ModelState, int, SamplingParams, int]  # request, state, next token, sampling, transfer
# a test's poison: a request whose context is in [lo, hi) ends the worker as it joins the batch ("lo:hi")
CRASH_AT_CONTEXT = "MINIFAAS_TEST_CRASH_AT_CONTEXT"


class DecodeService:
    def __init__(
        self,
        runtime: ModelRuntime,
        receiver: KVReceiver,
        state_timeout: float,
        config: DecoderConfig | None = None,
        prefixes: DecodePrefixCache | None = None,  # the node's received KV, which states are joined onto
    ) -> None:
        self.runtime, self.receiver, self.state_timeout, self.prefixes = runtime, receiver, state_timeout, prefixes
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
                state = await (incoming.model_state() if self.prefixes is None else self.prefixes.receive(incoming))
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
        self.arrivals.append((req, state, next_token, sampling, transfer))
        if not self.stepping:
            self._apply_pending()
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

    def _apply_pending(self) -> None:
        """Hand the decoder the aborts and arrivals that came in during a step (or an arrival between steps)."""
        for req in self.aborts:
            self.decoder.abort(req)
        self.aborts.clear()
        arrivals, self.arrivals = self.arrivals, []
        for req, state, next_token, sampling, transfer in arrivals:
            if req not in self.clients or self.clients[req][1] != transfer:
                continue  # aborted meanwhile (or replaced by a later attempt with the request's id)
            if state.seq_len in self.crash_at:
                os._exit(70)  # the poison request's test: the worker dies as this request joins its batch
            try:
                self.decoder.submit(req, state, next_token, sampling)
            except (QueueFull, ValueError) as e:  # full, or a bad state: this request fails, the others go on
                emit, _ = self.clients.pop(req)
                why = f"overloaded: {e}" if isinstance(e, QueueFull) else f"{type(e).__name__}: {e}"
                emit(Failed(req=req, transfer=transfer, error=why))

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
