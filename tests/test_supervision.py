"""Supervision of every process a real gateway starts: worker processes, the link emulator, signals.

A link emulator killed (SIGKILL) or hung (SIGSTOP) leaves service within its heartbeat deadline, long
prompts stay local while it is down and say why, /health and /metrics say what is down, and it comes
back with a route to every decode worker. A PD-P worker killed mid-prefill does not fail its request
while PrfaaS is healthy. A gateway killed with SIGKILL leaves no process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import served
from test_emulator_control import running

from minifaas.config import CacheConfig, ClusterConfig, ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.inter_cluster_link import NAME
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams
from minifaas.policy.router import RouteReason

HEARTBEAT_S, DEADLINE_S = 0.5, 2.0
CONFIG = ServeConfig(
    model="kimi-linear-tiny",
    threshold=200,
    fixed_threshold=True,
    pd=ClusterConfig(prefill_workers=1, decode_workers=2),
    cache=CacheConfig(mode="none"),
    heartbeat_s=HEARTBEAT_S,
    heartbeat_deadline_s=DEADLINE_S,
)
SHORT = [(7 * i + 2) % 256 for i in range(150)]
LONG = [(13 * i + 5) % 256 for i in range(600)]
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # a gateway of five processes, and another


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    rt = ModelRuntime.load("kimi-linear-tiny")
    return {"short": reference_tokens(rt, SHORT, PARAMS), "long": reference_tokens(rt, LONG, PARAMS)}


@pytest.fixture(scope="module")
def gateway(loop: asyncio.AbstractEventLoop, reference: dict) -> Iterator[Gateway]:
    yield from served(loop, CONFIG)  # type: ignore[misc]


def run(loop: asyncio.AbstractEventLoop, coro: object, seconds: float = 120) -> object:
    return loop.run_until_complete(asyncio.wait_for(coro, seconds))  # type: ignore[arg-type]


async def generate(gw: Gateway, rid: str, ids: list[int]) -> tuple[list[int], RequestRecord]:
    record = RequestRecord(rid, len(ids))
    tokens = [e.token_id async for e in gw.stream(GenerateRequest(rid, ids, PARAMS), record)]
    return tokens, record


async def until(condition: object, seconds: float) -> float:
    """Seconds until ``condition()`` holds, polled every 10 ms; TimeoutError after ``seconds``."""
    start = time.monotonic()
    async with asyncio.timeout(seconds):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.01)
    return time.monotonic() - start


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_lost_emulator_leaves_service_within_its_deadline_and_comes_back_routed(
    gateway: Gateway, loop: asyncio.AbstractEventLoop, reference: dict, sig: signal.Signals
) -> None:
    emulator = gateway.link.emulator
    assert emulator is not None and gateway.health()["links"] == {NAME: "up"}
    old, restarts = emulator.pid, gateway.link.restarts[NAME]

    async def scenario() -> None:
        os.kill(old, sig)
        gone = await until(lambda: not gateway.link.up, 10 + DEADLINE_S)
        # at once, in the same turn of the loop: long prompts stay local, and say why
        assert gateway.serving.route(LONG, None).reason is RouteReason.LONG_BUT_PRFAAS_DOWN
        assert gateway.health()["links"][NAME].startswith("down: ")
        # found by its own probe: an exited process at the next ping, a stopped one at the ping's deadline
        # (how soon depends on the host's load: the bound is the 12 s `until` above, not a timing check)
        why = gateway.health()["links"][NAME]
        assert ("no answer to a ping within" if sig == signal.SIGSTOP else "its process exited") in why, why
        print(f"{sig.name}: out of service after {gone:.2f} s (heartbeat {HEARTBEAT_S} s, deadline {DEADLINE_S} s)")
        await until(lambda: gateway.link.up, 30)
        assert gateway.link.restarts[NAME] == restarts + 1 and emulator.pid != old
        await asyncio.sleep(1.5)  # one sample of the live scheduler: /metrics has the restart
        # the restarted emulator routes to every decode worker again: a long prompt to each crosses it
        stats = await emulator.control.stats()
        targets = set(stats["routes"].values())
        assert targets == {f"{w.kv[0]}:{w.kv[1]}" for w in gateway.pool.of("pd", "decode")}  # type: ignore[index]
        for w in gateway.pool.of("pd", "decode"):
            w.load_tokens += 10_000  # steer the next request to the other decode worker
            tokens, record = await generate(gateway, f"after-{sig.name}-{w.name}", LONG)
            w.load_tokens -= 10_000
            assert (tokens, record.route, record.fallback) == (reference["long"], "prfaas", None), record.to_json()
            assert record.route_reason == "long"

    run(loop, scenario())
    assert not running(old), "the lost emulator was not replaced"
    text = gateway.metrics.exposition().decode()
    assert f'minifaas:process_up{{process="{NAME}"}} 1.0' in text
    assert f'minifaas:process_restarts{{process="{NAME}"}} {restarts + 1}.0' in text


def test_a_request_routed_while_the_link_is_down_stays_local_and_says_why(
    gateway: Gateway, loop: asyncio.AbstractEventLoop, reference: dict
) -> None:
    emulator = gateway.link.emulator
    assert emulator is not None

    async def scenario() -> tuple[list[int], RequestRecord]:
        os.kill(emulator.pid, signal.SIGSTOP)
        await until(lambda: not gateway.link.up, 10 + DEADLINE_S)
        result = await generate(gateway, "while-down", LONG)  # routed in this turn of the loop
        await until(lambda: gateway.link.up, 30)
        return result

    tokens, record = run(loop, scenario())  # type: ignore[misc]
    assert tokens == reference["long"]
    assert (record.route, record.route_reason) == ("local", "long_but_prfaas_down"), record.to_json()


def test_a_pd_prefill_killed_mid_prefill_is_retried_on_prfaas(
    gateway: Gateway, loop: asyncio.AbstractEventLoop, reference: dict
) -> None:
    pdp = gateway.pool.workers["pd-p0"]

    async def scenario() -> tuple[list[int], RequestRecord]:
        request = asyncio.create_task(generate(gateway, "pdp-killed", SHORT))
        await until(lambda: pdp.requests > 0, 30)
        pdp.kill()
        result = await request
        await until(lambda: pdp.alive, 120)  # the pool restarts it
        return result

    tokens, record = run(loop, scenario(), 200)  # type: ignore[misc]
    assert tokens == reference["short"], record.to_json()
    assert (record.route, record.prefill_worker, record.fallback) == ("prfaas", "prfaas-p0", "worker_lost")


def test_a_gateway_killed_with_sigkill_leaves_no_process_behind(tmp_path: object) -> None:
    argv = [sys.executable, "-m", "minifaas.commands.main", "serve", "--port", "0", "--model", "kimi-linear-tiny"]
    argv += ["--prfaas-workers", "1", "--pd-prefill-workers", "1", "--pd-decode-workers", "1"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            if "serving" in line and "http://" in line:
                break
        else:
            pytest.fail(f"the gateway did not start (exit {proc.wait()})")
        group = _group(proc.pid)
        assert len(group) >= 5, group  # the gateway, three workers and the link emulator
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _group(proc.pid):
            time.sleep(0.1)
        assert _group(proc.pid) == [], "children outlived a gateway killed with SIGKILL"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _group(pgid: int) -> list[str]:
    pids = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
    return [p for p in pids if running(int(p))]
