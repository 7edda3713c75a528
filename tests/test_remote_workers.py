"""Hand-started workers on loopback: their control port's security, and gateways that come and go.

Real ``minifaas worker`` processes and real ``minifaas serve`` processes; the
gateway is told the workers' addresses and attaches over the authenticated
control channel. Nothing here needs root.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
from hand_started import HandStarted, alive, start_all, write_secret

from minifaas.config import ClusterConfig, ServeConfig
from minifaas.control.secret import load_secret
from minifaas.control.session import Refused, Session, connect
from minifaas.control.worker_ops import Prefill, Sampling
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.gateway.workers import Busy, attach
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.model.tokenizer import ByteTokenizer
from minifaas.net.connections import CONTROL, HELLO_BYTES

pytestmark = pytest.mark.slow
PROMPT = [(7 * i + 3) % 256 for i in range(60)]
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A PD-P and a PD-D worker, started by hand; the secret file beside them."""
    tmp = tmp_path_factory.mktemp("workers")
    secret = write_secret(tmp)
    ports = {"pd-p0": _free_port(), "pd-d0": _free_port()}
    flags = ["--cluster", "pd", "--secret-file", str(secret), "--gateway-deadline", "3"]
    workers = {
        name: HandStarted(
            [*flags, "--role", role, "--name", name, "--listen", f"127.0.0.1:{ports[name]}"], tmp / f"{name}.log"
        )
        for name, role in (("pd-p0", "prefill"), ("pd-d0", "decode"))
    }
    start_all(list(workers.values()))
    addresses = tuple(f"127.0.0.1:{ports[n]}" for n in workers)
    yield {"workers": workers, "secret": secret, "addresses": addresses, "tmp": tmp}
    codes = [w.stop() for w in workers.values()]
    assert codes == [0, 0], f"workers did not stop cleanly on SIGTERM: {codes}"


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return reference_tokens(ModelRuntime.load("kimi-linear-tiny"), PROMPT, PARAMS)


def _config(cluster: dict) -> ServeConfig:
    return ServeConfig(
        model="kimi-linear-tiny",  # what the hand-started workers run
        threshold=10_000,
        secret_file=str(cluster["secret"]),
        prfaas=ClusterConfig(prefill_workers=0),
        pd=ClusterConfig(workers=cluster["addresses"]),
    )


async def _generate(gw: Gateway) -> list[int]:
    record = RequestRecord("r", len(PROMPT))
    return [e.token_id async for e in gw.stream(GenerateRequest("r", PROMPT, PARAMS), record)]


def test_control_port_refuses_strangers_a_second_gateway_and_bad_messages(cluster: dict, reference: list[int]) -> None:
    secret = load_secret(str(cluster["secret"]))
    host, port = cluster["addresses"][0].split(":")
    worker = cluster["workers"]["pd-p0"]

    async def main() -> None:
        # no secret: JSON lines straight at the port get the challenge and a hang-up
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b'{"op": "attach", "gateway": "x"}\n{"op": "prefill"}\n')
        assert (await reader.readexactly(HELLO_BYTES)).startswith(CONTROL)
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        with pytest.raises(Refused):
            await connect(host, int(port), b"a-wrong-secret-0123456789", 5.0)

        # with the secret: every malformed message is answered and the session goes on
        session, hello = await attach((host, int(port)), secret, 10.0)
        assert hello.name == "pd-p0" and hello.role == "prefill" and hello.pid == worker.pid
        bad = [
            {"op": "format_disk"},
            {"op": "prefill", "req": "x"},
            {"op": "prefill", "req": "x", "transfer": -1, "tokens": [1], "sampling": {}, "kv": ["h", 1],
             "link_start": 0},
            {"op": "prefill", "req": "x", "transfer": 1, "tokens": ["a"], "sampling": {}, "kv": ["h", 1],
             "link_start": 0},
            {"op": "decode", "req": "x", "transfer": 1, "tokens": [1], "link_start": 0,
             "sampling": {"max_tokens": 1, "temperature": 0, "top_p": 1, "seed": 0, "stop_token_ids": [],
                          "ignore_eos": False}},  # a prefill worker does not decode
            {**msgspec.to_builtins(Prefill(req="x", transfer=1, tokens=[1], sampling=Sampling.of(PARAMS), kv=("h", 1),
                                            link_start=0)),
             "codec": "zip"},  # a codec the worker does not know
            {"op": "start", "req": "x", "next_token": 1e308},
            {"op": "abort", "req": ["not", "a", "string"]},
            {"op": "load", "req": "x" * 100_000},
        ]  # fmt: skip
        for msg in bad:
            session.send(msg)
            reply = await _next_reply(session)
            assert reply["op"] == "error", (msg, reply)
        session.send({"op": "load", "req": "still-there"})
        assert (await _next_reply(session))["load"] == 0

        # a second client that holds the secret is refused while one is attached
        with pytest.raises(Busy):
            await attach((host, int(port)), secret, 10.0)
        session.close()

        # forged and oversized frames end that session only
        for frame in (b"\x00\x00\x00\x05" + b"\x00" * 32 + b"hello", struct.pack(">I", 1 << 31) + b"\x00" * 32):
            session, _ = await attach((host, int(port)), secret, 10.0)
            session._writer.write(frame)  # a frame whose MAC the session key did not make
            assert await _drained(session)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(os.urandom(4096))  # noise
        assert (await asyncio.wait_for(reader.read(), 10))[: len(CONTROL)] == CONTROL
        writer.close()

        # ... and the worker serves a gateway as before
        async with Gateway(_config(cluster)) as gw:
            assert await _generate(gw) == reference

    asyncio.run(main())
    assert alive(worker.pid) and worker.process.poll() is None  # type: ignore[union-attr]


async def _next_reply(session: Session) -> dict:
    while True:
        reply = await session.recv(10)
        assert reply is not None
        if reply["op"] != "cache":
            return reply


async def _drained(session: Session) -> bool:
    """The worker hung up on the session (after answering nothing more)."""
    while (reply := await session.recv(10)) is not None:
        assert reply["op"] == "cache", reply
    return True


def _serve(cluster: dict, port: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "minifaas.commands.main", "serve", "--port", str(port), "--prfaas-workers", "0",
            "--secret-file", str(cluster["secret"]), "--model", "kimi-linear-tiny"]  # fmt: skip
    for address in cluster["addresses"]:
        argv += ["--pd-worker", address]
    with log.open("a") as out:  # a file, not a pipe: nobody would drain a pipe once it serves
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    seen = log.stat().st_size
    deadline = time.monotonic() + 300
    while "serving" not in log.read_text()[seen:]:
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise AssertionError(f"the gateway did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return p


def _complete(port: int) -> str:
    body = json.dumps(
        {"model": "kimi-linear-tiny", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    )
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_a_gateway_killed_and_restarted_reattaches_to_the_same_workers(cluster: dict, reference: list[int]) -> None:
    expected = ByteTokenizer().decode(reference)
    pids = {name: w.pid for name, w in cluster["workers"].items()}
    log, port = cluster["tmp"] / "gateway.log", _free_port()
    first = _serve(cluster, port, log)
    try:
        assert _complete(port) == expected
    finally:
        first.kill()  # SIGKILL: no goodbye to the workers, whose sessions simply break
        first.wait(timeout=30)
    second = _serve(cluster, port, log)  # attaches at once: the workers noticed the broken sessions
    try:
        assert _complete(port) == expected
        assert {name: w.pid for name, w in cluster["workers"].items()} == pids  # not restarted
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            code = second.wait(timeout=60)
        finally:
            second.kill()
    assert code == 0, log.read_text()[-3000:]
    assert all(alive(pid) for pid in pids.values()), "a hand-started worker must outlive its gateway"


def test_a_worker_given_as_the_other_clusters_is_one_error_line(cluster: dict) -> None:
    """The PD prefill worker handed to --prfaas-worker: serve says which worker it met, and stops with code 1."""
    prefill, decode = cluster["addresses"]
    argv = [sys.executable, "-m", "minifaas.commands.main", "serve", "--port", "0", "--prfaas-worker", prefill,
            "--pd-worker", decode, "--secret-file", str(cluster["secret"]), "--model", "kimi-linear-tiny",
            "--no-rebalance"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    said = f"minifaas serve: the prfaas worker at {prefill} says it is the pd prefill worker pd-p0, where the prfaas"
    assert done.returncode == 1 and said in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert all(w.process.poll() is None for w in cluster["workers"].values())  # they wait for the next gateway


def test_hand_started_workers_with_no_decode_worker_among_them_are_one_error_line(cluster: dict) -> None:
    """Only the PD prefill worker handed to --pd-worker: every request would wait out its deadline for a decode
    worker, so serve stops at once, saying so."""
    prefill, _ = cluster["addresses"]
    argv = [sys.executable, "-m", "minifaas.commands.main", "serve", "--port", "0", "--pd-worker", prefill,
            "--secret-file", str(cluster["secret"]), "--model", "kimi-linear-tiny",
            "--prfaas-workers", "0"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    said = "minifaas serve: no decode worker in the PD cluster among the workers attached (pd-p0): every request"
    assert done.returncode == 1 and said in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert all(w.process.poll() is None for w in cluster["workers"].values())  # they wait for the next gateway


def test_a_worker_whose_starter_left_before_it_was_ready_stops_quietly(cluster: dict, tmp_path: Path) -> None:
    """Its ready line meets a closed pipe (a gateway that gave up on start): it stops, with no traceback."""
    argv = [sys.executable, "-m", "minifaas.commands.main", "worker", "--model", "kimi-linear-tiny", "--role",
            "prefill", "--cluster", "pd", "--secret-file", str(cluster["secret"]), "--threads", "1"]  # fmt: skip
    with (tmp_path / "worker.log").open("w") as log:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log)
    p.stdout.close()  # type: ignore[union-attr]
    assert p.wait(120) == 0
    assert "Traceback" not in (tmp_path / "worker.log").read_text()


def test_a_worker_that_answers_where_another_was_is_let_go_at_once(
    cluster: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A decode worker dies and another, under another name, comes up at its address: the gateway refuses it and
    hangs up, so the stranger is free for the gateway it belongs to."""
    secret = load_secret(str(cluster["secret"]))
    port = _free_port()
    flags = ["--cluster", "pd", "--role", "decode", "--secret-file", str(cluster["secret"]), "--listen",
             f"127.0.0.1:{port}"]  # fmt: skip
    ours = HandStarted([*flags, "--name", "pd-d9"], tmp_path / "ours.log").start()
    stranger = HandStarted([*flags, "--name", "stranger"], tmp_path / "stranger.log")
    ours.wait_ready()
    config = dataclasses.replace(
        _config(cluster), pd=ClusterConfig(workers=(cluster["addresses"][0], f"127.0.0.1:{port}"))
    )

    async def main() -> None:
        async with Gateway(config):
            ours.process.kill()  # type: ignore[union-attr]
            ours.process.wait()  # type: ignore[union-attr]
            stranger.start().wait_ready()
            refused = "stranger (decode) answers where pd-d9 was"
            async with asyncio.timeout(120):
                while not any(refused in r.getMessage() for r in caplog.records):
                    await asyncio.sleep(0.02)
            session, hello = await attach(("127.0.0.1", port), secret, 10.0)  # before the gateway's next try
            assert hello.name == "stranger"
            session.close()

    try:
        asyncio.run(main())
    finally:
        stranger.stop()
        ours.stop()
