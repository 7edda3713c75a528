"""The decode half of a request, as the client sees it: worker messages in, token events out.

The first token comes from the prefill worker, the rest from the decode worker within the deadline between
tokens. Text is detokenized incrementally and checked for stop strings here, since only the gateway sees it.
``EarlyFirst`` shows the first token as soon as the prefill worker has it, before the state's tail has crossed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from minifaas.control.worker_ops import Done, Error, Failed, Pinned, Received, Start, Token
from minifaas.gateway.migration import DecodeLost, suspect
from minifaas.gateway.requests import GenerateRequest, RequestDeadline, RequestFailed, RequestRecord, TokenEvent
from minifaas.gateway.stop_strings import StopMatcher
from minifaas.gateway.worker_handle import Inbound, Lost, WorkerHandle
from minifaas.model.sampling import SamplingParams
from minifaas.model.tokenizer import IncrementalDecoder, Tokenizer


@dataclass(frozen=True, slots=True)
class Handoff:
    """A done prefill, as the decode side goes on from it."""

    transfer: int
    first: int  # the first token after ``request``'s prompt
    request: GenerateRequest  # what was prefilled: the attempt's, or it with a shown early token appended


async def decode_tokens(
    done: Handoff, record: RequestRecord, tokenizer: Tokenizer, decode: WorkerHandle, inbox: asyncio.Queue[Inbound],
    deadline: RequestDeadline, text: OutputText, shown: bool = False,
) -> AsyncIterator[TokenEvent]:  # fmt: skip
    """``done.request`` is the attempt's (after a migration: prompt plus output so far); ``text`` and
    ``record.completion_tokens`` span every attempt. ``shown``: the first token's event went out already."""
    request, transfer, token = done.request, done.transfer, done.first
    finish = first_token_finish(token, request, tokenizer)
    rid = request.request_id
    if finish is None:
        try:
            decode.send(Start(req=rid, next_token=token))
        except RuntimeError as e:  # gone between the prefill and now
            raise DecodeLost(str(e)) from None
        decode.unstepped.add(rid)
    try:
        while True:
            if not shown:
                event = token_event(token, finish, text, record)
                yield event
                if event.finish_reason is not None:
                    return
            shown = False
            asked = time.perf_counter()
            async with deadline.next_token():
                msg = await inbox.get()
                while getattr(msg, "transfer", transfer) != transfer or isinstance(msg, (Received, Pinned)):
                    msg = await inbox.get()  # "received", or news of an abandoned transfer
            if record.first_step_s is None:
                record.first_step_s = time.perf_counter() - asked
            if isinstance(msg, Lost):
                raise DecodeLost(f"decode worker {decode.name} went away", decode.name, suspect(msg, rid), msg.pid)
            decode.unstepped.discard(rid)
            if isinstance(msg, Failed | Error):  # an Error: the worker refused the request's message
                raise RequestFailed(f"decode worker {decode.name}: {msg.error}")
            if isinstance(msg, Done):
                return
            if isinstance(msg, Token):
                token, finish = msg.token, msg.finish
    finally:
        decode.unstepped.discard(rid)


class OutputText:
    """A request's output as text: each token's piece, with stop strings cut and what may start one held back."""

    def __init__(self, tokenizer: Tokenizer, sampling: SamplingParams) -> None:
        self._detok = IncrementalDecoder(tokenizer)
        self._stops = StopMatcher(sampling.stop) if sampling.stop else None
        self._min_tokens = sampling.min_tokens

    def push(self, token: int, count: int) -> tuple[str, bool]:
        """The text to send after the ``count``-th token, and whether a stop string ended the output."""
        piece = self._detok.push(token)
        if self._stops is None:
            return piece, False
        return self._stops.feed(piece, stop_allowed=count >= self._min_tokens)

    def flush(self) -> str:
        """The rest, when the output ends without a stop string."""
        tail = self._detok.flush()
        if self._stops is None:
            return tail
        shown, stopped = self._stops.feed(tail)
        return shown if stopped else shown + self._stops.flush()


def token_event(token: int, finish: str | None, text: OutputText, record: RequestRecord) -> TokenEvent:
    """The next token's event: its text, and the reason the output ends with it (a stop string, or ``finish``)."""
    record.completion_tokens += 1
    piece, stopped = text.push(token, record.completion_tokens)
    if stopped or finish is not None:
        return TokenEvent(token, piece if stopped else piece + text.flush(), "stop" if stopped else finish)
    return TokenEvent(token, piece, None)


def first_token_finish(token: int, request: GenerateRequest, tokenizer: Tokenizer) -> str | None:
    """Why the output ends with its first token (the prefill's), if it does."""
    p = request.sampling
    if (token == tokenizer.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
        return "stop"
    return "length" if p.max_tokens <= 1 else None


class EarlyFirst:
    """Where the prefill (which offers the first token) and the gateway (which shows it) meet: a token is either
    shown, and a failed prefill is then redone after it, or withdrawn and never shown."""

    def __init__(self) -> None:
        self.token: int | None = None
        self.shown = False
        self.arrived = asyncio.Event()

    def offer(self, token: int) -> None:
        if not self.shown:
            self.token = token
            self.arrived.set()

    def show(self) -> int:
        """The gateway sends the token to the client: from now on the prefill must continue after it."""
        assert self.token is not None
        self.shown = True
        return self.token

    def withdraw(self) -> bool:
        """The attempt that offered the token failed: drop it unless it was shown. Returns ``shown``."""
        if not self.shown:
            self.token = None
            self.arrived.clear()
        return self.shown

    async def shown_before(self, prefill: asyncio.Future, ends_output: Callable[[int], bool]) -> int | None:
        """The first token to send before ``prefill`` ends, or None when the prefill ended first or the token
        ends the output (it then waits for the prefill's end, which may redo it)."""
        while not prefill.done():
            arrived = asyncio.ensure_future(self.arrived.wait())
            try:
                await asyncio.wait({prefill, arrived}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                arrived.cancel()
            if self.token is not None and not prefill.done():  # not withdrawn meanwhile
                if not ends_output(self.token):
                    return self.show()
                break
        await asyncio.wait({prefill})
        return None
