"""The HTTP layer against an in-memory gateway: OpenAI shapes, the official client, errors, auth, metrics.

The fake gateway stands in only for what end-to-end tests with real worker processes cover; every
byte here still goes through a real aiohttp server on a loopback socket.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from minifaas.config import HttpConfig
from minifaas.gateway.http_server import build_app
from minifaas.gateway.metrics import ServeMetrics
from minifaas.gateway.requests import GenerateRequest, Overloaded, RequestFailed, RequestRecord, TokenEvent
from minifaas.model.tokenizer import ByteTokenizer

MODEL = "tiny-hybrid"
REPLY = "The quick brown fox jumps over the lazy dog. "
KEY = "sk-test"


class FakeGateway:
    """Answers with REPLY cycled up to max_tokens; records what it was asked and which streams were closed early."""

    model_name = MODEL
    max_context = 64

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.aborted_event = asyncio.Event()
        self.endless = False
        self.refuse: Exception | None = None  # raised before the first token
        self.fail_after: int | None = None  # raise ``failure`` after this many tokens
        self.failure: Exception = RequestFailed("decode worker died")
        self.healthy = True
        self.reply: list[tuple[int, str]] | None = None  # (token id, its text) to answer with instead of REPLY

    def stream(self, request: GenerateRequest, record: RequestRecord) -> FakeStream:
        self.requests.append(request)
        record.route, record.prefill_worker, record.decode_worker = "local", "pd-p0", "pd-d0"
        record.cached_tokens, record.kv_bytes = 3, 4096
        if "fallback" in self.tokenizer.decode(request.prompt_ids):
            record.route, record.fallback = "prfaas", "link_cut"
        return FakeStream(self, request)

    def health(self) -> dict:
        return {"healthy": self.healthy, "workers": {"pd-p0": "ready"}}


class FakeStream:
    """An explicit iterator rather than an async generator, so only aclose() (never garbage collection
    or a cancelled await) counts as the HTTP layer closing it."""

    def __init__(self, gateway: FakeGateway, request: GenerateRequest) -> None:
        self.gateway, self.request = gateway, request
        self.sent = 0
        self.finished = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> TokenEvent:
        gw, n = self.gateway, self.request.sampling.max_tokens
        if gw.refuse is not None:
            raise gw.refuse
        if self.finished:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        if gw.fail_after is not None and self.sent == gw.fail_after:
            raise gw.failure
        token, text = gw.reply[self.sent % len(gw.reply)] if gw.reply else (ord(REPLY[self.sent % len(REPLY)]), "")
        text = text if gw.reply else chr(token)
        self.sent += 1
        self.finished = not gw.endless and self.sent == n
        return TokenEvent(token, text, "length" if self.finished else None)

    async def aclose(self) -> None:
        if not self.finished and self.gateway.fail_after is None:
            self.gateway.aborted.append(self.request.request_id)
            self.gateway.aborted_event.set()


@dataclass
class Served:
    gateway: FakeGateway
    metrics: ServeMetrics
    url: str
    client: aiohttp.ClientSession

    def openai(self, api_key: str = KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)


@asynccontextmanager
async def serving(
    api_key: str | None = KEY, max_body_bytes: int = 4 << 20, handler_cancellation: bool = False
) -> AsyncIterator[Served]:
    """The app on a real runner on 127.0.0.1 (handler_cancellation off by default, as in web.AppRunner)."""
    gateway, metrics = FakeGateway(), ServeMetrics()
    app = build_app(gateway, metrics, api_key, HttpConfig(max_body_bytes=max_body_bytes))
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}"
        async with aiohttp.ClientSession(url, headers={"Authorization": f"Bearer {KEY}"}) as client:
            yield Served(gateway, metrics, url, client)
    finally:
        await runner.cleanup()


def run_async(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 20))

    return wrapper


def sse_events(raw: str) -> list[Any]:
    """The data of each SSE event; "[DONE]" stays a string."""
    assert raw.endswith("\n\n")
    events = []
    for block in raw.strip("\n").split("\n\n"):
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric_samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def series(name: str, **labels: str) -> tuple[str, frozenset]:
    return name, frozenset(labels.items())


GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT_GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
C, CHAT = "/v1/completions", "/v1/chat/completions"

BAD_REQUESTS = [
    (C, b"{not json", 400, None),
    (C, b"\xff\xfe", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b"[" * 100_000, 400, None),
    (C, {"model": MODEL}, 400, "prompt"),
    (C, GOOD | {"prompt": 5}, 400, "prompt"),
    (C, GOOD | {"prompt": ""}, 400, "prompt"),
    (C, GOOD | {"prompt": []}, 400, "prompt"),
    (C, GOOD | {"prompt": ["a", "b"]}, 400, "prompt"),
    (C, GOOD | {"prompt": [1, 999]}, 400, "prompt"),
    (C, GOOD | {"prompt": [1, True]}, 400, "prompt"),
    (C, GOOD | {"prompt": "x" * 64}, 400, "prompt"),
    (C, GOOD | {"prompt": "x" * 10, "max_tokens": 60}, 400, "max_tokens"),
    (C, GOOD | {"max_tokens": 0}, 400, "max_tokens"),
    (C, GOOD | {"max_tokens": -3}, 400, "max_tokens"),
    (C, GOOD | {"max_tokens": "4"}, 400, "max_tokens"),
    (C, GOOD | {"max_tokens": True}, 400, "max_tokens"),
    (C, GOOD | {"max_tokens": 2.5}, 400, "max_tokens"),
    (C, GOOD | {"temperature": "hot"}, 400, "temperature"),
    (C, GOOD | {"temperature": -1}, 400, "temperature"),
    (C, GOOD | {"top_p": 0}, 400, "top_p"),
    (C, GOOD | {"seed": -1}, 400, "seed"),
    (C, GOOD | {"seed": "1"}, 400, "seed"),
    (C, GOOD | {"stop": 5}, 400, "stop"),
    (C, GOOD | {"stop": ["ok", 3]}, 400, "stop"),
    (C, GOOD | {"stop_token_ids": 5}, 400, "stop_token_ids"),
    (C, GOOD | {"stop_token_ids": [5, -1]}, 400, "stop_token_ids"),
    (C, GOOD | {"stop_token_ids": [True]}, 400, "stop_token_ids"),
    (C, GOOD | {"stop_token_ids": [1 << 20]}, 400, "stop_token_ids"),
    (C, GOOD | {"min_tokens": 1, "stop_token_ids": [t for t in range(264) if t != 257]}, 400, "min_tokens"),  # +EOS
    (CHAT, CHAT_GOOD | {"min_tokens": 2, "stop_token_ids": list(range(264)), "temperature": 0}, 400, "min_tokens"),
    (C, GOOD | {"n": 2}, 400, "n"),
    (C, GOOD | {"stream": "yes"}, 400, "stream"),
    (C, GOOD | {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, GOOD | {"logprobs": 2}, 400, "logprobs"),
    (C, GOOD | {"model": 7}, 400, "model"),
    (C, GOOD | {"model": "gpt-4"}, 404, "model"),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, CHAT_GOOD | {"messages": []}, 400, "messages"),
    (CHAT, CHAT_GOOD | {"messages": ["hi"]}, 400, "messages[0]"),
    (CHAT, CHAT_GOOD | {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, CHAT_GOOD | {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    (CHAT, CHAT_GOOD | {"messages": [{"role": "user", "content": "x" * 60}]}, 400, "messages"),
    (CHAT, CHAT_GOOD | {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, CHAT_GOOD | {"model": "gpt-4"}, 404, "model"),
    (CHAT, CHAT_GOOD | {"n": 3}, 400, "n"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
@run_async
async def test_bad_input_gets_openai_error_and_server_stays_healthy(
    path: str, body: bytes | dict, status: int, param: str | None
) -> None:
    async with serving() as s:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        resp = await s.client.post(path, data=data, headers={"Content-Type": "application/json"})
        assert resp.status == status
        error = (await resp.json())["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and error["type"] == "invalid_request_error"
        assert error["param"] == param
        if status == 404:
            assert error["code"] == "model_not_found"
        assert s.gateway.requests == []  # rejected before reaching the gateway

        assert (await s.client.get("/health")).status == 200
        good = await s.client.post(path, json=GOOD if path == C else CHAT_GOOD)
        assert good.status == 200
        assert len(s.gateway.requests) == 1
        samples = metric_samples(await (await s.client.get("/metrics")).text())
        assert samples[series("minifaas:requests_total", route="none", outcome="invalid")] == 1


class ThreadNoting(ByteTokenizer):
    """Notes whether each prompt was tokenized on the event loop's thread."""

    def __init__(self) -> None:
        self.on_loop: list[bool] = []

    def encode(self, text: str) -> list[int]:
        self.on_loop.append(threading.current_thread() is threading.main_thread())
        return super().encode(text)


@pytest.mark.parametrize("path", [C, CHAT])
@run_async
async def test_a_large_prompt_is_tokenized_off_the_event_loop(path: str) -> None:
    """Tokenizing megabytes takes seconds: on the loop, every other client's stream would stall meanwhile."""
    async with serving() as s:
        s.gateway.tokenizer = tokenizer = ThreadNoting()
        for text, status, on_loop in (("hello", 200, True), ("x" * (1 << 20), 400, False)):  # past the context
            message = {"role": "user", "content": text}
            body = GOOD | {"prompt": text} if path == C else CHAT_GOOD | {"messages": [message]}
            tokenizer.on_loop.clear()
            resp = await s.client.post(path, json=body)
            assert resp.status == status and tokenizer.on_loop and set(tokenizer.on_loop) == {on_loop}


@pytest.mark.parametrize("chunked", [False, True])
@run_async
async def test_body_over_the_limit_is_413(chunked: bool) -> None:
    async with serving(max_body_bytes=1024) as s:
        body = json.dumps(GOOD | {"prompt": "x" * 2000}).encode()

        async def pieces() -> AsyncIterator[bytes]:
            for i in range(0, len(body), 256):
                yield body[i : i + 256]

        resp = await s.client.post(C, data=pieces() if chunked else body, headers={"Content-Type": "application/json"})
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"
        assert (await s.client.post(C, json=GOOD)).status == 200


@pytest.mark.parametrize(
    ("prompt", "ids"), [("hi", [104, 105]), ([104, 105], [104, 105]), (["hi"], [104, 105]), ([[7, 8]], [7, 8])]
)
@run_async
async def test_prompt_forms(prompt: Any, ids: list[int]) -> None:
    async with serving() as s:
        assert (await s.client.post(C, json=GOOD | {"prompt": prompt})).status == 200
        assert s.gateway.requests[0].prompt_ids == ids


@run_async
async def test_completion_body_shape() -> None:
    async with serving() as s:
        body = await (await s.client.post(C, json=GOOD | {"max_tokens": 5})).json()
        assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
        assert body["choices"] == [{"index": 0, "text": REPLY[:5], "logprobs": None, "finish_reason": "length"}]
        assert body["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": 5,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 3},
        }
        info = body["minifaas"]
        assert info["request_id"] == body["id"] == s.gateway.requests[0].request_id
        assert (info["route"], info["prefill_worker"], info["decode_worker"]) == ("local", "pd-p0", "pd-d0")
        assert (info["prompt_tokens"], info["cached_tokens"], info["completion_tokens"]) == (5, 3, 5)
        assert info["kv_bytes"] == 4096 and info["ttft_s"] >= 0 and info["e2e_s"] >= info["ttft_s"]


@run_async
async def test_chat_body_shape_and_sampling_passthrough() -> None:
    async with serving() as s:
        request = CHAT_GOOD | {"max_completion_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": "x"}
        body = await (await s.client.post(CHAT, json=request)).json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY[:3]}
        assert body["choices"][0]["finish_reason"] == "length"
        sent = s.gateway.requests[0]
        assert sent.prompt_ids == ByteTokenizer().chat([{"role": "user", "content": "hi"}])
        assert body["usage"]["prompt_tokens"] == len(sent.prompt_ids)
        sp = sent.sampling
        assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed, sp.stop) == (3, 0.5, 0.9, 7, ("x",))
        await s.client.post(C, json={"model": MODEL, "prompt": "a", "stop": ["p", "q"], "stop_token_ids": [10, 0]})
        assert s.gateway.requests[1].sampling.stop == ("p", "q")
        assert s.gateway.requests[1].sampling.stop_token_ids == (10, 0)
        assert s.gateway.requests[1].sampling.max_tokens == 16  # OpenAI's default


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("path", [C, CHAT])
@run_async
async def test_stream_shape(path: str, include_usage: bool) -> None:
    async with serving() as s:
        request = (GOOD if path == C else CHAT_GOOD) | {"max_tokens": 6, "stream": True}
        if include_usage:
            request["stream_options"] = {"include_usage": True}
        resp = await s.client.post(path, json=request)
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        *chunks, done = sse_events(await resp.text())
        assert done == "[DONE]"
        assert len({c["id"] for c in chunks}) == 1
        expected_object = "text_completion" if path == C else "chat.completion.chunk"
        assert all(c["object"] == expected_object for c in chunks)
        if include_usage:
            *chunks, usage_chunk = chunks
            assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
            assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
            assert all(c["usage"] is None for c in chunks)
            last = usage_chunk
        else:
            assert all("usage" not in c for c in chunks)
            last = chunks[-1]
        assert last["minifaas"]["route"] == "local" and last["minifaas"]["completion_tokens"] == 6
        assert sum("minifaas" in c for c in chunks) == (0 if include_usage else 1)
        choices = [c["choices"][0] for c in chunks]
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
        if path == C:
            text = "".join(c["text"] for c in choices)
        else:
            assert choices[0]["delta"] == {"role": "assistant", "content": ""} and choices[-1]["delta"] == {}
            text = "".join(c["delta"].get("content", "") for c in choices)
        assert text == REPLY[:6]


@run_async
async def test_the_first_token_is_streamed_at_once_even_inside_a_character() -> None:
    """A token that starts a multi-byte character has no text yet. The first one is sent anyway, as an empty
    chunk, so the client sees its time to first token; a later one waits to go out with the rest."""
    u_umlaut = [(0xC3, ""), (0xBC, "ü")]  # the two bytes of one character: the text comes with the second
    async with serving() as s:
        for reply, texts in (([*u_umlaut, (0x78, "x")], ["", "ü", "x"]), ([(0x78, "x"), *u_umlaut], ["x", "ü"])):
            s.gateway.reply = reply
            resp = await s.client.post(C, json=GOOD | {"max_tokens": 3, "stream": True})
            *chunks, done = sse_events(await resp.text())
            assert done == "[DONE]" and chunks[-1]["choices"][0]["text"] == ""  # the closing chunk
            assert [c["choices"][0]["text"] for c in chunks[:-1]] == texts


@pytest.mark.parametrize("path", [C, CHAT])
@run_async
async def test_return_token_ids_gives_every_id_once_streamed_or_not(path: str) -> None:
    """vLLM's ``return_token_ids``: the ids ride with the text; a token whose text is held back (inside a
    character) has its id in the next chunk, so the stream's ids join to the whole output."""
    reply = [(0x78, "x"), (0xC3, ""), (0xBC, "ü"), (0x79, "y")]
    request = (GOOD if path == C else CHAT_GOOD) | {"max_tokens": 4, "return_token_ids": True}
    async with serving() as s:
        s.gateway.reply = reply
        body = await (await s.client.post(path, json=request)).json()
        prompt = s.gateway.requests[-1].prompt_ids
        assert body["choices"][0]["token_ids"] == [0x78, 0xC3, 0xBC, 0x79]
        assert body["choices"][0]["prompt_token_ids"] == prompt
        resp = await s.client.post(path, json=request | {"stream": True})
        *chunks, done = sse_events(await resp.text())
        assert done == "[DONE]"
        choices = [c["choices"][0] for c in chunks]
        assert [t for c in choices for t in c["token_ids"]] == [0x78, 0xC3, 0xBC, 0x79]
        assert [c.get("prompt_token_ids") for c in choices] == [prompt] + [None] * (len(choices) - 1)
        plain = await (await s.client.post(path, json=request | {"return_token_ids": False})).json()
        assert "token_ids" not in plain["choices"][0]


@run_async
async def test_official_openai_client() -> None:
    async with serving() as s:
        client = s.openai()
        completion = await client.completions.create(model=MODEL, prompt="hello", max_tokens=7)
        assert completion.choices[0].text == REPLY[:7] and completion.usage.completion_tokens == 7
        assert completion.model_extra["minifaas"]["route"] == "local"

        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4
        )
        assert chat.choices[0].message.content == REPLY[:4] and chat.choices[0].finish_reason == "length"

        stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=5, stream=True)
        assert "".join([chunk.choices[0].text async for chunk in stream]) == REPLY[:5]

        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY[:5]
        assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 3

        assert [m.id async for m in client.models.list()] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="gpt-4", prompt="hi")
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
        with pytest.raises(openai.AuthenticationError):
            await s.openai(api_key="wrong").completions.create(model=MODEL, prompt="hi")


@run_async
async def test_api_key_guards_v1_only() -> None:
    async with serving() as s:
        no_key = {"Authorization": ""}
        for headers in (no_key, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
            resp = await s.client.post(C, json=GOOD, headers=headers)
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
        assert (await s.client.get("/v1/models", headers=no_key)).status == 401
        resp = await s.client.get("/v1/nowhere")
        assert resp.status == 404 and (await resp.json())["error"]["type"] == "invalid_request_error"
        assert (await s.client.get("/health", headers=no_key)).status == 200
        assert (await s.client.get("/metrics", headers=no_key)).status == 200
        assert s.gateway.requests == []
        assert (await s.client.post(C, json=GOOD)).status == 200
        for scheme in ("bearer", "BEARER", "Bearer  "):  # the scheme's case is the client's; spaces may follow it
            assert (await s.client.post(C, json=GOOD, headers={"Authorization": f"{scheme} {KEY}"})).status == 200
        assert (await s.client.post(C, json=GOOD, headers={"Authorization": f"Basic {KEY}"})).status == 401
    async with serving(api_key=None) as s:
        assert (await s.client.post(C, json=GOOD, headers=no_key)).status == 200


@run_async
async def test_models_and_health() -> None:
    async with serving() as s:
        models = await (await s.client.get("/v1/models")).json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
        resp = await s.client.get("/health")
        assert resp.status == 200 and (await resp.json())["workers"] == {"pd-p0": "ready"}
        s.gateway.healthy = False
        resp = await s.client.get("/health")
        assert resp.status == 503 and (await resp.json())["healthy"] is False


@pytest.mark.parametrize(("refusal", "status"), [(Overloaded("queue full"), 503), (RequestFailed("all lost"), 500)])
@pytest.mark.parametrize("stream", [False, True])
@run_async
async def test_gateway_refusal_maps_to_status(refusal: Exception, status: int, stream: bool) -> None:
    async with serving() as s:
        s.gateway.refuse = refusal
        resp = await s.client.post(C, json=GOOD | {"stream": stream})
        assert resp.status == status
        error = (await resp.json())["error"]
        assert error["type"] == "server_error" and error["message"] == str(refusal)
        s.gateway.refuse = None
        assert (await s.client.post(C, json=GOOD)).status == 200


@run_async
async def test_failure_mid_stream_is_an_error_event() -> None:
    async with serving() as s:
        s.gateway.fail_after = 2
        resp = await s.client.post(C, json=GOOD | {"stream": True})
        *chunks, error, done = sse_events(await resp.text())
        assert [c["choices"][0]["text"] for c in chunks] == list(REPLY[:2])
        assert error["error"]["message"] == "decode worker died" and done == "[DONE]"
        samples = metric_samples(await (await s.client.get("/metrics")).text())
        assert samples[series("minifaas:requests_total", route="local", outcome="error")] == 1


@pytest.mark.parametrize("handler_cancellation", [False, True])
@pytest.mark.parametrize("path", [C, CHAT])
@run_async
async def test_client_disconnect_mid_stream_closes_the_gateway_stream(path: str, handler_cancellation: bool) -> None:
    async with serving(handler_cancellation=handler_cancellation) as s:
        s.gateway.endless = True
        resp = await s.client.post(path, json=(GOOD if path == C else CHAT_GOOD) | {"stream": True})
        assert resp.status == 200
        first = await resp.content.readline()
        assert first.startswith(b"data: {")
        resp.close()  # drops the connection with the stream unfinished
        await s.gateway.aborted_event.wait()
        assert s.gateway.aborted == [s.gateway.requests[0].request_id]

        abort = series("minifaas:requests_total", route="local", outcome="abort")
        while metric_samples(await (await s.client.get("/metrics")).text()).get(abort) != 1:
            await asyncio.sleep(0.01)  # the handler records the outcome just after the close
        s.gateway.endless = False
        assert (await s.client.get("/health")).status == 200
        assert (await s.client.post(path, json=GOOD if path == C else CHAT_GOOD)).status == 200
        assert len(s.gateway.aborted) == 1  # a finished stream is not an abort


@run_async
async def test_client_gone_before_a_non_streamed_answer_closes_the_gateway_stream() -> None:
    """Needs the runner's handler_cancellation: without it aiohttp only notices a dead client on a write."""
    async with serving(handler_cancellation=True) as s:
        s.gateway.endless = True
        post = asyncio.ensure_future(s.client.post(C, json=GOOD))
        while not s.gateway.requests:
            await asyncio.sleep(0.01)
        post.cancel()  # the client gives up and its connection is closed
        await s.gateway.aborted_event.wait()
        assert s.gateway.aborted == [s.gateway.requests[0].request_id]
        s.gateway.endless = False
        assert (await s.client.post(C, json=GOOD)).status == 200


@run_async
async def test_metrics_series_after_requests() -> None:
    async with serving() as s:
        await s.client.post(C, json=GOOD | {"max_tokens": 5})
        await s.client.post(CHAT, json=CHAT_GOOD | {"max_tokens": 3, "stream": True})
        await s.client.post(C, json=GOOD | {"prompt": "please fallback", "max_tokens": 2})
        await s.client.post(C, json=GOOD | {"max_tokens": 0})
        s.metrics.set_queue_depth("prfaas_prefill", 3)
        s.metrics.set_link_health("prfaas->pd", 0.25, 0.0, 0.0)
        s.metrics.add_kv_bytes("prfaas->pd", 1000)
        s.metrics.add_kv_bytes("prfaas->pd", 24)
        s.metrics.add_kv_bytes("prfaas->pd", 4096, 3000, "lossless")

        resp = await s.client.get("/metrics")
        assert resp.status == 200 and resp.content_type == "text/plain"
        samples = metric_samples(await resp.text())

        def value(name: str, **labels: str) -> float:
            return samples[series(name, **labels)]

        assert value("minifaas:requests_total", route="local", outcome="length") == 2
        assert value("minifaas:requests_total", route="prfaas", outcome="length") == 1
        assert value("minifaas:requests_total", route="none", outcome="invalid") == 1
        assert value("minifaas:time_to_first_token_seconds_count", route="local") == 2
        assert value("minifaas:time_per_output_token_seconds_count", route="local") == 2
        assert value("minifaas:e2e_request_latency_seconds_count", route="prfaas") == 1
        chat_prompt = len(ByteTokenizer().chat(CHAT_GOOD["messages"]))
        assert value("minifaas:prompt_tokens_total") == 5 + chat_prompt + len("please fallback")
        assert value("minifaas:prompt_tokens_cached_total") == 9
        assert value("minifaas:generation_tokens_total") == 5 + 3 + 2
        assert value("minifaas:fallbacks_total", reason="link_cut") == 1
        assert value("minifaas:queue_depth", stage="prfaas_prefill") == 3
        assert value("minifaas:link_utilization", link="prfaas->pd") == 0.25
        # the state's size, and what crossed the wire by the codec that coded it
        assert value("minifaas:kv_bytes_sent_total", link="prfaas->pd") == 1024 + 4096
        assert value("minifaas:kv_wire_bytes_sent_total", link="prfaas->pd", codec="none") == 1024
        assert value("minifaas:kv_wire_bytes_sent_total", link="prfaas->pd", codec="lossless") == 3000
        assert value("minifaas:num_requests_running") == 0


def test_metrics_registries_are_separate() -> None:
    a, b = ServeMetrics(), ServeMetrics()
    assert b'minifaas:time_to_first_token_seconds_count{route="prfaas"} 0.0' in b.exposition()
    a.add_kv_bytes("l", 5)
    assert b"minifaas:kv_bytes_sent_total" in a.exposition()
    assert b'kv_bytes_sent_total{link="l"}' not in b.exposition()
