"""OpenAI response bodies and stream chunks for one request, assembled as its token events arrive.

Sans-IO like openai_schema: the handler feeds events in and writes out what comes back.
Streams follow OpenAI's order: content chunks (chat opens with a role-only delta), then a chunk
with an empty delta and the finish_reason, then, with include_usage, a chunk whose choices are
empty and which carries usage. The last chunk before ``data: [DONE]`` carries the ``minifaas``
object, as every non-streamed body does. With ``return_token_ids`` (vLLM's field) each choice also carries
the ids of its tokens (``token_ids``; in a stream, those since the last chunk) and, once, ``prompt_token_ids``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from minifaas.gateway.openai_schema import APIEndpoint
from minifaas.gateway.requests import RequestRecord, TokenEvent

_OBJECT = {APIEndpoint.COMPLETIONS: "text_completion", APIEndpoint.CHAT: "chat.completion"}
_CHUNK_OBJECT = {APIEndpoint.COMPLETIONS: "text_completion", APIEndpoint.CHAT: "chat.completion.chunk"}
_ID_PREFIX = {APIEndpoint.COMPLETIONS: "cmpl-", APIEndpoint.CHAT: "chatcmpl-"}


@dataclass(slots=True)
class CompletionReply:
    endpoint: APIEndpoint
    model: str
    record: RequestRecord
    started: float  # time.perf_counter() when the request arrived
    created: int = field(default_factory=lambda: int(time.time()))
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    prompt_ids: list[int] | None = None  # set: the client asked for token ids
    token_ids: list[int] = field(default_factory=list)
    ids_sent: int = 0  # token ids already in a stream chunk
    prompt_sent: bool = False

    @classmethod
    def start(
        cls, endpoint: APIEndpoint, model: str, prompt_ids: list[int], started: float, return_token_ids: bool = False
    ) -> CompletionReply:
        request_id = _ID_PREFIX[endpoint] + uuid.uuid4().hex
        record = RequestRecord(request_id, len(prompt_ids))
        return cls(endpoint, model, record, started, prompt_ids=prompt_ids if return_token_ids else None)

    @property
    def id(self) -> str:
        return self.record.request_id

    def add(self, event: TokenEvent, now: float) -> str:
        """Take one token event; returns its text."""
        if self.first_token_at is None:
            self.first_token_at = now
        self.tokens += 1
        self.pieces.append(event.text)
        self.token_ids.append(event.token_id)
        self.finish_reason = event.finish_reason
        return event.text

    def seal(self, now: float) -> None:
        """Write what the HTTP layer measured into the record; the gateway's own timings win where it set them."""
        self.record.completion_tokens = self.tokens
        if self.record.ttft_s is None and self.first_token_at is not None:
            self.record.ttft_s = self.first_token_at - self.started
        if self.record.e2e_s is None:
            self.record.e2e_s = now - self.started

    def usage(self) -> dict[str, Any]:
        prompt = self.record.prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.tokens,
            "total_tokens": prompt + self.tokens,
            "prompt_tokens_details": {"cached_tokens": self.record.cached_tokens},
        }

    # -- a whole body ---------------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        text = "".join(self.pieces)
        if self.endpoint is APIEndpoint.CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": self.finish_reason}
        if self.prompt_ids is not None:
            choice |= {"prompt_token_ids": self.prompt_ids, "token_ids": self.token_ids}
        return self._envelope(_OBJECT[self.endpoint], [choice]) | {
            "usage": self.usage(),
            "minifaas": self.record.to_json(),
        }

    # -- stream chunks --------------------------------------------------------------------------

    def opening_chunks(self, include_usage: bool) -> list[dict[str, Any]]:
        if self.endpoint is APIEndpoint.CHAT:
            return [self._chunk({"role": "assistant", "content": ""}, None, include_usage)]
        return []

    def content_chunk(self, text: str, include_usage: bool) -> dict[str, Any]:
        delta = {"content": text} if self.endpoint is APIEndpoint.CHAT else text
        return self._chunk(delta, None, include_usage)

    def closing_chunks(self, include_usage: bool) -> list[dict[str, Any]]:
        done = self._chunk({} if self.endpoint is APIEndpoint.CHAT else "", self.finish_reason, include_usage)
        chunks = [done]
        if include_usage:
            chunks.append(self._envelope(_CHUNK_OBJECT[self.endpoint], []) | {"usage": self.usage()})
        chunks[-1]["minifaas"] = self.record.to_json()
        return chunks

    def _chunk(self, delta: dict[str, str] | str, finish_reason: str | None, include_usage: bool) -> dict[str, Any]:
        if isinstance(delta, str):
            choice: dict[str, Any] = {"index": 0, "text": delta, "logprobs": None}
        else:
            choice = {"index": 0, "delta": delta, "logprobs": None}
        choice["finish_reason"] = finish_reason
        if self.prompt_ids is not None:
            if not self.prompt_sent:
                choice["prompt_token_ids"], self.prompt_sent = self.prompt_ids, True
            choice["token_ids"] = self.token_ids[self.ids_sent :]
            self.ids_sent = len(self.token_ids)
        out = self._envelope(_CHUNK_OBJECT[self.endpoint], [choice])
        if include_usage:
            out["usage"] = None  # OpenAI sends null on every chunk but the usage one
        return out

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
