"""`minifaas serve` end to end: real worker processes, real sockets, the official openai client."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from serve_child import serving

from minifaas.model.interleaved_decoder import generate
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.model.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow  # a `minifaas serve` process and the openai client

SHORT = "To be, or not to be: that is the question."
LONG = "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune. " * 14
KEY = "test-key"


def _get(url: str, key: str | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if body.startswith("{") else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def _post(url: str, body: bytes, key: str = KEY) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


@pytest.fixture(scope="module")
def serve_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """A ``minifaas serve`` process: its URL, and the lines it logged until it served."""
    key_file = tmp_path_factory.mktemp("serve") / "api-key"
    key_file.write_text(KEY + "\n")  # from a file, so the key is not in ps
    flags = ["--model", "kimi-linear-tiny", "--threshold", "300", "--api-key-file", str(key_file)]
    with serving(*flags, "--link-rate", "50mbit", "--kv-compression", "lossless") as served:
        yield served


@pytest.fixture(scope="module")
def server(serve_process: tuple[str, list[str]]) -> str:
    return serve_process[0]


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    rt = ModelRuntime.load("kimi-linear-tiny")
    tok = ByteTokenizer()
    p = SamplingParams(max_tokens=12)
    texts = {"short": SHORT, "long": LONG}
    return {name: tok.decode(reference_tokens(rt, tok.encode(text), p)) for name, text in texts.items()}


def test_openai_client_completions_and_chat(server: str, reference: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    model = client.models.list().data[0].id
    short = client.completions.create(model=model, prompt=SHORT, max_tokens=12, temperature=0)
    long = client.completions.create(model=model, prompt=LONG, max_tokens=12, temperature=0)
    assert short.choices[0].text == reference["short"] and long.choices[0].text == reference["long"]
    assert short.model_extra["minifaas"]["route"] == "local"
    assert long.model_extra["minifaas"]["route"] == "prfaas"
    rt = ModelRuntime.load("kimi-linear-tiny")
    info = long.model_extra["minifaas"]
    assert info["kv_bytes"] == rt.prefill(ByteTokenizer().encode(LONG)).state.nbytes
    # coded across the link and decoded bit for bit: the text equals one-process generate's
    assert (info["kv_codec"], info["kv_codec_reason"]) == ("lossless", "forced")
    assert 0 < info["kv_wire_bytes"] < info["kv_bytes"] and info["kv_encode_s"] > 0 and info["kv_decode_s"] > 0
    assert short.model_extra["minifaas"]["kv_codec"] == "none"  # the local route is never coded
    streamed = client.completions.create(
        model=model, prompt=LONG, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["long"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    parts = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True, temperature=0
        )
    )
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content


def test_concurrent_mixed_requests_all_complete(server: str, reference: dict[str, str]) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=300)

    async def one(i: int) -> tuple[int, str]:
        prompt = LONG if i % 4 == 0 else SHORT
        r = await client.completions.create(model="kimi-linear-tiny", prompt=prompt, max_tokens=12, temperature=0)
        return i, r.choices[0].text

    async def all_of_them() -> list[tuple[int, str]]:
        return await asyncio.gather(*(one(i) for i in range(32)))

    for i, text in asyncio.run(all_of_them()):
        assert text == reference["long" if i % 4 == 0 else "short"], i


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (json.dumps({"model": "kimi-linear-tiny"}).encode(), 400),
        (json.dumps({"model": "kimi-linear-tiny", "prompt": 5}).encode(), 400),
        (json.dumps({"model": "kimi-linear-tiny", "prompt": "x", "max_tokens": 0}).encode(), 400),
        (json.dumps({"model": "kimi-linear-tiny", "prompt": "x", "max_tokens": 10**7}).encode(), 400),
        (json.dumps({"model": "kimi-linear-tiny", "prompt": "x" * 40000}).encode(), 400),
        (json.dumps({"model": "no-such-model", "prompt": "x"}).encode(), 404),
        (json.dumps({"model": "kimi-linear-tiny", "prompt": "x" * (5 << 20)}).encode(), 413),
    ],
)
def test_bad_input_gets_4xx_and_the_server_stays_healthy(server: str, body: bytes, status: int) -> None:
    code, reply = _post(f"{server}/v1/completions", body)
    assert code == status and "message" in reply["error"]
    ok, good = _post(
        f"{server}/v1/completions",
        json.dumps(
            {"model": "kimi-linear-tiny", "prompt": "a", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        ).encode(),
    )
    assert ok == 200 and good["usage"]["completion_tokens"] == 2


def test_sampling_fields_are_honoured_as_generate_honours_them(server: str) -> None:
    params = {"max_tokens": 10, "temperature": 0.7, "seed": 11, "top_k": 8, "min_tokens": 4, "frequency_penalty": 1.0}
    code, reply = _post(
        f"{server}/v1/completions", json.dumps({"model": "kimi-linear-tiny", "prompt": SHORT} | params).encode()
    )
    assert code == 200, reply
    rt, tok = ModelRuntime.load("kimi-linear-tiny"), ByteTokenizer()
    expected = generate(rt, tok.encode(SHORT), SamplingParams(**params))
    assert reply["choices"][0]["text"] == tok.decode(expected)
    code, reply = _post(f"{server}/v1/completions", b'{"model": "kimi-linear-tiny", "prompt": "\\ud800"}')
    assert code == 400 and "lone surrogate" in reply["error"]["message"]


def test_stop_token_ids_end_the_output_as_generate_ends_it(server: str) -> None:
    rt, tok = ModelRuntime.load("kimi-linear-tiny"), ByteTokenizer()
    greedy = reference_tokens(rt, tok.encode(SHORT), SamplingParams(max_tokens=8, ignore_eos=True))
    for stop in (greedy[0], greedy[3]):  # the prefill's token, and one a decode step makes
        params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop]}
        body = {"model": "kimi-linear-tiny", "prompt": SHORT, "return_token_ids": True} | params
        code, reply = _post(f"{server}/v1/completions", json.dumps(body).encode())
        assert code == 200, reply
        expected = reference_tokens(rt, tok.encode(SHORT), SamplingParams(**params))
        choice = reply["choices"][0]
        assert choice["token_ids"] == expected == greedy[: greedy.index(stop) + 1], (choice, greedy)
        assert choice["finish_reason"] == "stop"


def test_api_key_health_and_metrics(server: str) -> None:
    # a long prompt of its own (no earlier one shares its prefix), so the PrfaaS and codec series below hold
    # whatever ran before
    body = {"model": "kimi-linear-tiny", "prompt": "Metrics. " + LONG, "max_tokens": 2, "temperature": 0}
    code, reply = _post(f"{server}/v1/completions", json.dumps(body).encode())
    assert code == 200 and reply["minifaas"]["route"] == "prfaas", reply
    assert _get(f"{server}/v1/models")[0] == 401
    assert _get(f"{server}/v1/models", KEY)[0] == 200
    code, health = _get(f"{server}/health")
    assert code == 200 and health["healthy"]
    assert set(health["kernels"].values()) == {"torch"}  # kimi-linear-tiny on the CPU: the reference kernels
    assert set(health["kernels"]) == set(health["workers"])
    code, text = _get(f"{server}/metrics")
    for worker in health["workers"]:
        assert f'minifaas:worker_kernels{{kernels="torch",worker="{worker}"}} 1.0' in text
    assert code == 200 and "minifaas:time_to_first_token_seconds" in text and 'route="prfaas"' in text
    assert 'minifaas:kv_codec_choices_total{codec="lossless",reason="forced"}' in text
    state, wire = (
        _metric(text, f'minifaas:kv_codec_{side}_bytes_total{{codec="lossless"}}') for side in ("state", "wire")
    )
    assert state > wire > 0 and _metric(text, 'minifaas:kv_codec_seconds_total{codec="lossless",side="decode"}') > 0
    assert _metric(text, "minifaas:kv_codec_break_even_bits_per_second") > 0  # measured when the workers started


def _metric(text: str, series: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(series + " ")))


def test_client_disconnect_mid_stream_frees_the_request(server: str) -> None:
    async def go() -> None:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY)
        stream = await client.completions.create(model="kimi-linear-tiny", prompt=SHORT, max_tokens=400, stream=True)
        async for _ in stream:
            break
        await stream.close()
        await client.close()

    asyncio.run(go())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _get(f"{server}/health")[1]["inflight"] != 0:
        time.sleep(0.2)
    assert _get(f"{server}/health")[1]["inflight"] == 0
    assert 'outcome="abort"' in _get(f"{server}/metrics")[1]


def test_start_up_logs_each_process_starting_then_ready(serve_process: tuple[str, list[str]]) -> None:
    lines = serve_process[1]
    for name in ("prfaas-p0", "pd-p0", "pd-d0", "prfaas->pd"):
        starting = next(i for i, line in enumerate(lines) if f"{name} (" in line and "starting" in line)
        ready = next(i for i, line in enumerate(lines) if f"{name} (" in line and "ready after" in line)
        assert starting < ready, f"{name}: ready before starting"
    assert "t 300, rule scarce: moved by the link's use from now on" in "".join(lines)


def test_an_idle_server_reports_empty_queues(server: str) -> None:
    """Each worker's cache-events inbox is open for its whole life: it is not a queued request."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _get(f"{server}/health")[1]["inflight"] != 0:
        time.sleep(0.2)
    depths: dict[str, float] = {}
    while time.monotonic() < deadline:  # the gateway samples its queues once a second
        text = str(_get(f"{server}/metrics")[1])
        depths = {
            line.split('stage="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("minifaas:queue_depth{")
        }
        if set(depths) == {"prfaas_prefill", "pd_prefill", "decode"} and not any(depths.values()):
            break
        time.sleep(0.5)
    assert depths == {"prfaas_prefill": 0, "pd_prefill": 0, "decode": 0}


def test_an_open_api_on_every_interface_is_warned_of(serve_process: tuple[str, list[str]]) -> None:
    """--host 0.0.0.0 and no API key: serve says anyone who reaches it may send requests. The module's server
    (a key, on 127.0.0.1) says nothing of the kind."""
    warning = "takes requests from anyone who reaches it"
    with serving("--model", "kimi-linear-tiny", "--host", "0.0.0.0", "--prfaas-workers", "0") as (_, lines):
        deadline = time.monotonic() + 30
        while not any(warning in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(warning in line and "WARNING" in line for line in lines), "".join(lines)[-3000:]
    assert not any(warning in line for line in serve_process[1])
