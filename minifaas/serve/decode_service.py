"""A decode worker's job: take a request's state off the KV receiver and decode it with the others.

Requests interleave: each round steps every active request by one token, in
one call on the model thread, then hands the tokens back to the event loop.
No request waits for another to finish. (Row-batched forward passes are the
next step; interleaving keeps the per-request state handling obvious.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from minifaas.model.runtime import DecodeStream, ModelRuntime
from minifaas.serve.control import sampling_from_json
from minifaas.transport import KVReceiver

Emit = Callable[[dict], None]


class DecodeService:
    def __init__(self, runtime: ModelRuntime, receiver: KVReceiver, state_timeout: float) -> None:
        self.runtime, self.receiver, self.state_timeout = runtime, receiver, state_timeout
        self.active: dict[str, tuple[DecodeStream, Emit, int]] = {}
        self.first_tokens: dict[str, asyncio.Future[int]] = {}
        self.wakeup = asyncio.Event()

    def _first_token(self, req: str) -> asyncio.Future[int]:
        if req not in self.first_tokens:
            self.first_tokens[req] = asyncio.get_running_loop().create_future()
        return self.first_tokens[req]

    async def decode(self, msg: dict, emit: Emit) -> None:
        """Wait for the state and the first token, then join the decode rounds."""
        req, transfer = msg["req"], msg["transfer"]
        sampling = sampling_from_json(msg["sampling"])
        incoming = self.receiver.transfer(transfer)
        first = self._first_token(req)
        try:
            async with asyncio.timeout(self.state_timeout):
                state = await incoming.model_state()
            emit({"op": "received", "req": req, "transfer": transfer, "bytes": state.nbytes})
            async with asyncio.timeout(self.state_timeout):
                next_token = await first
        finally:
            if self.first_tokens.get(req) is first:
                del self.first_tokens[req]
        stream = await asyncio.to_thread(self.runtime.start_decode, state, next_token, sampling)
        if stream.finished:
            emit({"op": "done", "req": req, "transfer": transfer, "finish": stream.finish_reason})
            return
        self.active[req] = (stream, emit, transfer)
        self.wakeup.set()

    def start(self, req: str, next_token: int) -> None:
        future = self._first_token(req)
        if not future.done():
            future.set_result(next_token)

    def abort(self, req: str) -> None:
        self.active.pop(req, None)
        future = self.first_tokens.pop(req, None)
        if future is not None and not future.done():
            future.cancel()

    async def run(self) -> None:
        while True:
            await self.wakeup.wait()
            if not self.active:
                self.wakeup.clear()
                continue
            batch = [(req, stream) for req, (stream, _, _) in self.active.items()]
            results = await asyncio.to_thread(_round, batch)
            for req, token, finish in results:
                entry = self.active.get(req)
                if entry is None:  # aborted while its token was being computed
                    continue
                entry[1]({"op": "token", "req": req, "transfer": entry[2], "token": token, "finish": finish})
                if finish is not None:
                    del self.active[req]


def _round(batch: list[tuple[str, DecodeStream]]) -> list[tuple[str, int, str | None]]:
    out = []
    for req, stream in batch:
        token = stream.step()
        out.append((req, token, stream.finish_reason))
    return out
