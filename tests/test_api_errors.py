"""Every error the HTTP layer returns: an OpenAI error body, counted in /metrics by cause, 503s with Retry-After.

Over a real aiohttp server on loopback with the in-memory gateway of test_api (the end-to-end
tests with real workers are test_serve's): unexpected exceptions, text that is not Unicode,
fields this server does not implement, stop strings past the caps, deadlines.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from test_api import CHAT, CHAT_GOOD, GOOD, C, metric_samples, run_async, serving, sse_events

from minifaas.gateway.requests import DeadlineExceeded, Overloaded
from minifaas.gateway.stop_strings import MAX_STOP_CHARS, MAX_STOPS


async def errors_by_cause(s: Any) -> dict[str, float]:
    samples = metric_samples(await (await s.client.get("/metrics")).text())
    return {
        dict(labels)["cause"]: v for (name, labels), v in samples.items() if name == "minifaas:request_errors_total"
    }


@pytest.mark.parametrize("stream", [False, True])
@run_async
async def test_an_unexpected_exception_is_a_json_500_counted_and_logged(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving() as s:
        s.gateway.refuse = ZeroDivisionError("a bug")
        with caplog.at_level(logging.ERROR, logger="minifaas.api"):
            resp = await s.client.post(C, json=GOOD | {"stream": stream})
        assert resp.status == 500 and resp.content_type == "application/json"
        error = (await resp.json())["error"]
        assert error["code"] == "internal_error" and error["type"] == "server_error"
        assert "ZeroDivisionError" in error["message"] and "trouble" not in error["message"]
        assert "ZeroDivisionError: a bug" in caplog.text  # the trace is in the log, not in the reply
        assert (await errors_by_cause(s))["internal_error"] == 1
        s.gateway.refuse = None
        assert (await s.client.post(C, json=GOOD)).status == 200


@run_async
async def test_an_unexpected_exception_mid_stream_is_an_error_event() -> None:
    async with serving() as s:
        s.gateway.fail_after, s.gateway.failure = 2, KeyError("row")
        *chunks, error, done = sse_events(await (await s.client.post(C, json=GOOD | {"stream": True})).text())
        assert len(chunks) == 2 and done == "[DONE]"
        assert error["error"]["code"] == "internal_error" and "KeyError" in error["error"]["message"]
        assert (await errors_by_cause(s))["internal_error"] == 1


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/", 404), ("POST", "/health", 405)])
@run_async
async def test_routing_errors_outside_v1_are_json_too(method: str, path: str, status: int) -> None:
    async with serving() as s:
        resp = await s.client.request(method, path)
        assert resp.status == status and set((await resp.json())["error"]) == {"message", "type", "param", "code"}
        cause = {404: "not_found", 405: "method_not_allowed"}[status]
        assert (await errors_by_cause(s))[cause] == 1
        if status == 405:  # which methods the path takes, as HTTP requires of a 405
            assert "GET" in resp.headers["Allow"].split(",")


SURROGATE = '"\\ud800"'  # JSON may carry it; no UTF-8 encoder can


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (C, '{"model": "tiny-hybrid", "prompt": %s}', "prompt"),
        (C, '{"model": "tiny-hybrid", "prompt": "ok", "stop": [%s]}', "stop"),
        (CHAT, '{"model": "tiny-hybrid", "messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
        (CHAT, '{"model": "tiny-hybrid", "messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
         "messages[0].content"),
    ],
)  # fmt: skip
@run_async
async def test_a_lone_surrogate_is_a_400_not_a_500(path: str, body: str, param: str) -> None:
    async with serving() as s:
        resp = await s.client.post(path, data=body % SURROGATE, headers={"Content-Type": "application/json"})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["param"] == param and "lone surrogate (U+D800)" in error["message"]
        assert (await errors_by_cause(s))["invalid_request"] == 1


REFUSED = [
    ("logit_bias", {"65": 10}),
    ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"),
    ("min_p", 0.1),
    ("repetition_penalty", 1.2),
    ("logprobs", True),
    ("echo", True),
    ("guided_json", {"type": "object"}),
]
NEUTRAL = [("logit_bias", {}), ("response_format", {"type": "text"}), ("tool_choice", "none"), ("min_p", 0.0),
           ("repetition_penalty", 1), ("logprobs", False), ("tools", [])]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), REFUSED)
@run_async
async def test_unsupported_fields_are_refused_by_name(field: str, value: Any) -> None:
    async with serving() as s:
        for path, body in ((C, GOOD), (CHAT, CHAT_GOOD)):
            resp = await s.client.post(path, json=body | {field: value})
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert error["param"] == field and error["message"] == f"'{field}' is not supported by this server."
        assert s.gateway.requests == []


@run_async
async def test_fields_that_ask_for_nothing_are_accepted() -> None:
    async with serving() as s:
        resp = await s.client.post(CHAT, json=CHAT_GOOD | dict(NEUTRAL))
        assert resp.status == 200, await resp.text()


@run_async
async def test_top_k_min_tokens_and_penalties_reach_the_sampler() -> None:
    async with serving() as s:
        extra = {"top_k": 5, "min_tokens": 3, "presence_penalty": 0.5, "frequency_penalty": -1}
        assert (await s.client.post(C, json=GOOD | extra)).status == 200
        assert (await s.client.post(C, json=GOOD | {"top_k": -1})).status == 200  # vLLM's "all tokens"
        first, second = (r.sampling for r in s.gateway.requests)
        assert (first.top_k, first.min_tokens, first.presence_penalty, first.frequency_penalty) == (5, 3, 0.5, -1.0)
        assert second.top_k == 0
        for bad in (
            {"top_k": -2},
            {"top_k": 2**31},
            {"min_tokens": 9},
            {"presence_penalty": 3},
            {"frequency_penalty": "x"},
        ):
            resp = await s.client.post(C, json=GOOD | bad)
            assert resp.status == 400 and (await resp.json())["error"]["param"] == next(iter(bad)), bad


@pytest.mark.parametrize(
    "stop", [[f"s{i}" for i in range(MAX_STOPS + 1)], ["x" * (MAX_STOP_CHARS + 1)]], ids=["too many", "too long"]
)
@run_async
async def test_stop_strings_are_capped(stop: list[str]) -> None:
    async with serving() as s:
        resp = await s.client.post(C, json=GOOD | {"stop": stop})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "stop"
        ok = [f"s{i}" for i in range(MAX_STOPS)]
        assert (await s.client.post(C, json=GOOD | {"stop": ok})).status == 200


@run_async
async def test_every_503_carries_retry_after() -> None:
    async with serving() as s:
        s.gateway.refuse = Overloaded("queue full")
        for stream in (False, True):
            resp = await s.client.post(C, json=GOOD | {"stream": stream})
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        s.gateway.refuse = Overloaded("the queue ahead passes the first-token deadline", retry_after=7)
        resp = await s.client.post(C, json=GOOD | {"stream": True})
        assert resp.status == 503 and resp.headers["Retry-After"] == "7"
        assert (await resp.json())["error"]["code"] == "overloaded"
        s.gateway.healthy = False
        resp = await s.client.get("/health")
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert (await errors_by_cause(s))["overloaded"] == 3


@run_async
async def test_a_deadline_is_a_504_before_the_first_token_and_an_error_event_after() -> None:
    async with serving() as s:
        s.gateway.refuse = DeadlineExceeded("no first token within 300 s")
        resp = await s.client.post(C, json=GOOD)
        assert resp.status == 504 and (await resp.json())["error"]["code"] == "timeout"
        s.gateway.refuse = None
        s.gateway.fail_after, s.gateway.failure = 1, DeadlineExceeded("no token for 60 s")
        *_, error, _ = sse_events(await (await s.client.post(C, json=GOOD | {"stream": True})).text())
        assert error["error"] == {
            "message": "no token for 60 s",
            "type": "server_error",
            "param": None,
            "code": "timeout",
        }
        assert (await errors_by_cause(s))["timeout"] == 2
