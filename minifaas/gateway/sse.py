"""A completion streamed as server-sent events: its chunks in OpenAI's order, written as the tokens come.

The headers go out with the first token, so a request refused or failed before it still gets a real status; an
error after them goes in the stream as an OpenAI error body, as vLLM sends it, and ``[DONE]`` ends every stream,
one the server cuts as it shuts down too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from minifaas.gateway.api_errors import APIError, api_error, cause_of
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.openai_schema import APIEndpoint, CompletionReply, check_finished
from minifaas.gateway.requests import RequestFailed, TokenEvent

log = logging.getLogger("minifaas.api")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_CHUNK_OBJECT = {APIEndpoint.COMPLETIONS: "text_completion", APIEndpoint.CHAT: "chat.completion.chunk"}
CUT = APIError(503, "The server is shutting down: the stream was cut before it finished.", code="shutting_down")


async def stream_reply(
    request: web.Request, reply: CompletionReply, events: AsyncIterator[TokenEvent], include_usage: bool,
    metrics: ServeMetrics, cutting: Callable[[], bool],
) -> tuple[web.StreamResponse, str]:  # fmt: skip
    """Stream ``events`` as ``reply``'s chunks; the response and the request's outcome. A cancellation while
    ``cutting()`` (the server's grace is over) ends the stream with ``CUT``, any other passes on."""
    first = await anext(events, None)  # Overloaded / RequestFailed here still become an HTTP status
    if first is None:
        raise RequestFailed("the gateway ended the stream before the first token")
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    chunks = Chunks(reply, include_usage)
    try:
        try:
            for chunk in chunks.opening():
                await _send(response, chunk)
            await _send_token(response, chunks, first)
            async for event in events:
                await _send_token(response, chunks, event)
            check_finished(reply)
            reply.seal(time.perf_counter())
            for chunk in chunks.closing():
                await _send(response, chunk)
            outcome = str(reply.finish_reason)
        except ConnectionResetError:
            raise
        except Exception as e:  # after the 200: the error goes in the stream, as vLLM sends it
            error = api_error(e)
            if error.code == "internal_error":
                log.exception("stream of %s failed", reply.id)
            metrics.request_error(cause_of(error))
            await _send(response, error.body())
            outcome = "error"
        await response.write(b"data: [DONE]\n\n")
    except ConnectionResetError:  # the client went away: leaving closes the gateway's iterator
        return response, "abort"
    except asyncio.CancelledError:
        if not cutting():
            raise
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        metrics.request_error(cause_of(CUT))
        with contextlib.suppress(ConnectionResetError):
            await _send(response, CUT.body())
            await response.write(b"data: [DONE]\n\n")
        return response, "error"
    return response, outcome


async def _send_token(response: web.StreamResponse, chunks: Chunks, event: TokenEvent) -> None:
    text = chunks.reply.add(event, time.perf_counter())
    # A token inside a multi-byte character has no text of its own yet, and waits for the rest; but the
    # first token's chunk goes out at once, with whatever text it has, so a client sees when it came.
    if text or len(chunks.reply.token_ids) == 1:
        await _send(response, chunks.content(text))


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")


class Chunks:
    """A reply's stream chunks: an opening one (chat), one per piece of text, a closing one and the usage's."""

    def __init__(self, reply: CompletionReply, include_usage: bool) -> None:
        self.reply, self.include_usage = reply, include_usage
        self.ids_sent = 0  # token ids already in a chunk
        self.prompt_sent = False

    def opening(self) -> list[dict[str, Any]]:
        if self.reply.endpoint is APIEndpoint.CHAT:
            return [self._chunk({"role": "assistant", "content": ""}, None)]
        return []

    def content(self, text: str) -> dict[str, Any]:
        delta = {"content": text} if self.reply.endpoint is APIEndpoint.CHAT else text
        return self._chunk(delta, None)

    def closing(self) -> list[dict[str, Any]]:
        reply = self.reply
        chunks = [self._chunk({} if reply.endpoint is APIEndpoint.CHAT else "", reply.finish_reason)]
        if self.include_usage:
            chunks.append(reply.envelope(_CHUNK_OBJECT[reply.endpoint], []) | {"usage": reply.usage()})
        chunks[-1]["minifaas"] = reply.record.to_json()
        return chunks

    def _chunk(self, delta: dict[str, str] | str, finish_reason: str | None) -> dict[str, Any]:
        if isinstance(delta, str):
            choice: dict[str, Any] = {"index": 0, "text": delta, "logprobs": None}
        else:
            choice = {"index": 0, "delta": delta, "logprobs": None}
        choice["finish_reason"] = finish_reason
        reply = self.reply
        if reply.prompt_ids is not None:
            if not self.prompt_sent:
                choice["prompt_token_ids"], self.prompt_sent = reply.prompt_ids, True
            choice["token_ids"] = reply.token_ids[self.ids_sent :]
            self.ids_sent = len(reply.token_ids)
        out = reply.envelope(_CHUNK_OBJECT[reply.endpoint], [choice])
        if self.include_usage:
            out["usage"] = None  # OpenAI sends null on every chunk but the usage one
        return out
