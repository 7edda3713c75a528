"""The decode half of a request, as the client sees it: worker messages in, token events out.

The first token comes from the prefill worker; the decode worker streams the
rest. Text is detokenized incrementally (never splitting a UTF-8 character) and
checked for stop strings here, since only the gateway sees the text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from minifaas.model.tokenizer import IncrementalDecoder, Tokenizer
from minifaas.serve.requests import GenerateRequest, RequestFailed, RequestRecord, TokenEvent
from minifaas.serve.worker_handle import WorkerHandle


async def decode_tokens(
    request: GenerateRequest,
    record: RequestRecord,
    tokenizer: Tokenizer,
    decode: WorkerHandle,
    inbox: asyncio.Queue[dict],
    transfer: int,
    first: int,
) -> AsyncIterator[TokenEvent]:
    detok = IncrementalDecoder(tokenizer)
    stops, text = request.sampling.stop, ""
    token, finish = first, finish_reason(first, 1, request, tokenizer)
    if finish is None:
        decode.send({"op": "start", "req": request.request_id, "next_token": first})
    while True:
        record.completion_tokens += 1
        piece = detok.push(token)
        if stops and piece:
            cut = find_stop(text, piece, stops)
            if cut is not None:
                yield TokenEvent(token, piece[:cut], "stop")
                return
        text += piece
        yield TokenEvent(token, piece, finish)
        if finish is not None:
            return
        msg = await inbox.get()
        while msg.get("transfer", transfer) != transfer or msg["op"] in ("received", "pinned"):
            msg = await inbox.get()  # "received", or news of an abandoned transfer
        if msg["op"] in ("lost", "failed"):
            raise RequestFailed(f"decode worker {decode.name}: {msg.get('error', 'went away')}")
        if msg["op"] == "done":
            return
        if msg["op"] == "token":
            token, finish = msg["token"], msg["finish"]


def finish_reason(token: int, count: int, request: GenerateRequest, tokenizer: Tokenizer) -> str | None:
    p = request.sampling
    if (token == tokenizer.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
        return "stop"
    return "length" if count >= p.max_tokens else None


def find_stop(text: str, piece: str, stops: tuple[str, ...]) -> int | None:
    """Where in ``piece`` the output must end, if ``text + piece`` now contains a stop string."""
    combined = text + piece
    window_start = max(0, len(text) - max(len(x) for x in stops) + 1)
    hits = [i for x in stops if (i := combined.find(x, window_start)) != -1]
    return max(min(hits) - len(text), 0) if hits else None
