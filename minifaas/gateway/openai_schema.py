"""OpenAI request bodies in, validated token ids and SamplingParams out; the response body back.

Sans-IO, so every rule is tested without a server. A field minifaas does not implement is refused by name with a
400 unless it asks for nothing; unknown extra fields are ignored. ``CompletionReply`` gathers the tokens into a
response body (``gateway.sse`` streams them as chunks).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from minifaas.gateway.api_errors import APIError
from minifaas.gateway.requests import RequestFailed, RequestRecord, TokenEvent
from minifaas.gateway.stop_strings import MAX_STOP_CHARS, MAX_STOPS
from minifaas.model.sampling import SamplingParams
from minifaas.model.tokenizer import Tokenizer


class APIEndpoint(Enum):
    COMPLETIONS = "completions"
    CHAT = "chat.completions"


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool = False


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
               list: "an array"}  # fmt: skip
# Fields not implemented here, each with the values that ask for nothing (and so are accepted).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "use_beam_search": (None, False),
} | dict.fromkeys(("audio", "prediction", "reasoning_effort", "web_search_options", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar"), (None,))  # fmt: skip
_ROLES = ("system", "developer", "user", "assistant")
_DEFAULT_MAX_TOKENS = 16
MAX_STOP_TOKEN_IDS = 4096  # as many as a control message carries


def parse_request(
    endpoint: APIEndpoint, raw: bytes, *, model_name: str, tokenizer: Tokenizer, max_context: int
) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    _check_fields(body, model_name)
    prompt_ids, max_tokens = _prompt_and_budget(endpoint, body, tokenizer, max_context)
    stream = _field(body, "stream", bool, False)
    options = _field(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise APIError(400, "'stream_options' may only be set when 'stream' is true.", param="stream_options")
    include_usage = _field(options or {}, "include_usage", bool, False, param="stream_options.include_usage")
    return_ids = _field(body, "return_token_ids", bool, False)
    sampling = _sampling(body, max_tokens, tokenizer.vocab_size)
    banned = {*sampling.stop_token_ids, *(() if sampling.ignore_eos else (tokenizer.eos_token_id,))}
    if sampling.min_tokens and len(banned) >= tokenizer.vocab_size:
        message = "'min_tokens' leaves no token to generate: 'stop_token_ids' and the end of sequence cover every one."
        raise APIError(400, message, param="min_tokens")
    return ParsedRequest(prompt_ids, sampling, stream, include_usage, return_ids)


def _check_fields(body: dict[str, Any], model_name: str) -> None:
    """The model is this server's, and no field asks for what it does not implement."""
    model = _field(body, "model", str, model_name)
    if model != model_name:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    for name, nothing in _UNSUPPORTED.items():
        value = body.get(name)
        if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in nothing):
            raise APIError(400, f"'{name}' is not supported by this server.", param=name)
    if _field(body, "n", int, 1) != 1:
        raise APIError(400, "Only n=1 is supported: send one request per choice.", param="n")


def _prompt_and_budget(
    endpoint: APIEndpoint, body: dict[str, Any], tokenizer: Tokenizer, max_context: int
) -> tuple[list[int], int]:
    """The prompt's token ids and the completion's max_tokens, checked against the model's context."""
    if endpoint is APIEndpoint.CHAT:  # its newer max_completion_tokens wins over max_tokens
        prompt_ids, prompt_param = tokenizer.chat(_messages(body)), "messages"
        param = "max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens"
    else:
        prompt_ids, prompt_param, param = _prompt_ids(body, tokenizer), "prompt", "max_tokens"
    max_tokens = _field(body, param, int, _DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise APIError(400, f"'{param}' must be at least 1, got {max_tokens}.", param=param)
    if len(prompt_ids) >= max_context:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens, "
            f"but the prompt has {len(prompt_ids)} tokens.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if len(prompt_ids) + max_tokens > max_context:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} "
            f"in the completion). Please reduce '{param}'.",
            param=param,
            code="context_length_exceeded",
        )
    return prompt_ids, max_tokens


def _sampling(body: dict[str, Any], max_tokens: int, vocab_size: int) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_field(body, "temperature", (int, float), 1.0)),
            top_p=float(_field(body, "top_p", (int, float), 1.0)),
            top_k=_top_k(body),
            min_tokens=_field(body, "min_tokens", int, 0),
            presence_penalty=float(_field(body, "presence_penalty", (int, float), 0.0)),
            frequency_penalty=float(_field(body, "frequency_penalty", (int, float), 0.0)),
            seed=_field(body, "seed", int, None),
            stop=_stop(body),
            stop_token_ids=_stop_token_ids(body, vocab_size),
            ignore_eos=_field(body, "ignore_eos", bool, False),
        )
    except ValueError as e:  # SamplingParams messages start with the field's name
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=name if name in body else None) from None


def _stop_token_ids(body: dict[str, Any], vocab_size: int) -> tuple[int, ...]:
    """Token ids that end the output where they are generated (the token itself is output)."""
    ids = _field(body, "stop_token_ids", list, [])
    if len(ids) > MAX_STOP_TOKEN_IDS or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        message = f"'stop_token_ids' must be at most {MAX_STOP_TOKEN_IDS} token ids in [0, {vocab_size})."
        raise APIError(400, message, param="stop_token_ids")
    return tuple(ids)


def _field(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any, param: str = "") -> Any:
    """body[name] if present and of the given type(s); ``default`` if absent or null."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = _TYPE_NAMES[float if float in kinds else kinds[0]]
        raise APIError(400, f"'{param or name}' must be {expected}, got {json.dumps(value)[:40]}.", param=param or name)
    return value


def _required(body: dict[str, Any], name: str) -> Any:
    if body.get(name) is None:
        raise APIError(400, f"'{name}' is a required property.", param=name)
    return body[name]


def _prompt_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = _required(body, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(_unicode(prompt, "prompt"))
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        if any(not 0 <= t < tokenizer.vocab_size for t in ids):
            raise APIError(400, f"Token ids must be in [0, {tokenizer.vocab_size}).", param="prompt")
    elif isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
        raise APIError(400, "Batched prompts are not supported: send one prompt per request.", param="prompt")
    else:
        raise APIError(400, "'prompt' must be a string or an array of token ids.", param="prompt")
    if not ids:
        raise APIError(400, "'prompt' must not be empty.", param="prompt")
    return ids


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = _required(body, "messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty array.", param="messages")
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"'{param}' must be an object.", param=param)
        role = _field(message, "role", str, None, param=f"{param}.role")
        if role not in _ROLES:
            raise APIError(400, f"'{param}.role' must be one of {', '.join(_ROLES)}.", param=f"{param}.role")
        out.append({"role": role, "content": _content(message.get("content"), f"{param}.content")})
    return out


def _content(content: Any, param: str) -> str:
    """A message's text: a string, or an array of {"type": "text", "text": ...} parts joined."""
    if isinstance(content, str):
        return _unicode(content, param)
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return _unicode("".join(p["text"] for p in content), param)
    raise APIError(400, f"'{param}' must be a string or an array of text parts.", param=param)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "'stop' must be a non-empty string or an array of them.", param="stop")
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"'stop' may hold at most {MAX_STOPS} strings, got {len(stops)}.", param="stop")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise APIError(400, f"A stop string may be at most {MAX_STOP_CHARS} characters long.", param="stop")
        _unicode(s, "stop")
    return tuple(stops)


def _top_k(body: dict[str, Any]) -> int:
    top_k = _field(body, "top_k", int, 0)
    return 0 if top_k == -1 else top_k  # vLLM's -1 and 0 both mean all tokens


def _unicode(text: str, param: str) -> str:
    """``text`` if it can be encoded; JSON can carry a lone surrogate ("\\ud800"), which no tokenizer can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = f"U+{ord(text[e.start]):04X}"
        message = f"'{param}' is not valid Unicode: a lone surrogate ({code}) at character {e.start}."
        raise APIError(400, message, param=param) from None
    return text


_OBJECT = {APIEndpoint.COMPLETIONS: "text_completion", APIEndpoint.CHAT: "chat.completion"}
_ID_PREFIX = {APIEndpoint.COMPLETIONS: "cmpl-", APIEndpoint.CHAT: "chatcmpl-"}


@dataclass(slots=True)
class CompletionReply:
    endpoint: APIEndpoint
    model: str
    record: RequestRecord
    started: float  # time.perf_counter() when the request arrived
    created: int = field(default_factory=lambda: int(time.time()))
    pieces: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    finish_reason: str | None = None
    prompt_ids: list[int] | None = None  # set: the client asked for token ids
    token_ids: list[int] = field(default_factory=list)

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
        self.pieces.append(event.text)
        self.token_ids.append(event.token_id)
        self.finish_reason = event.finish_reason
        return event.text

    def seal(self, now: float) -> None:
        """Write what the HTTP layer measured into the record; the gateway's own timings win where it set them."""
        self.record.completion_tokens = len(self.token_ids)
        if self.record.ttft_s is None and self.first_token_at is not None:
            self.record.ttft_s = self.first_token_at - self.started
        if self.record.e2e_s is None:
            self.record.e2e_s = now - self.started

    def usage(self) -> dict[str, Any]:
        prompt, tokens = self.record.prompt_tokens, len(self.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": tokens,
            "total_tokens": prompt + tokens,
            "prompt_tokens_details": {"cached_tokens": self.record.cached_tokens},
        }

    def body(self) -> dict[str, Any]:
        text = "".join(self.pieces)
        if self.endpoint is APIEndpoint.CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": self.finish_reason}
        if self.prompt_ids is not None:
            choice |= {"prompt_token_ids": self.prompt_ids, "token_ids": self.token_ids}
        return self.envelope(_OBJECT[self.endpoint], [choice]) | {
            "usage": self.usage(),
            "minifaas": self.record.to_json(),
        }

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


def check_finished(reply: CompletionReply) -> None:
    if reply.finish_reason is None:
        raise RequestFailed("the gateway ended the stream without a finish reason")
