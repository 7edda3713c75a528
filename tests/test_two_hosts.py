"""Two hosts on one machine: the PrfaaS worker in one network namespace, the PD workers in another.

The namespaces are joined by a veth with a tbf bottleneck (``NetnsLink``),
and each has an unshaped veth to the root namespace, where the gateway runs.
The workers are hand-started ``minifaas worker`` processes; the gateway
attaches to them over the authenticated control channel, and the PrfaaS KV
crosses the real kernel bottleneck, not the emulator. Root only.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import pytest
from hand_started import HandStarted, alive, start_all, write_secret
from netns import NetnsLink, unavailable

from minifaas.config import CacheConfig, ClusterConfig, InterClusterLinkConfig, ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, Phase, RequestRecord
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

_NO_NETNS = unavailable()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_NO_NETNS is not None, reason=_NO_NETNS or "")]

RATE = "20mbit"
THRESHOLD = 200
SHORT = [(7 * i) % 256 for i in range(40)]
LONG = [(13 * i + 5) % 256 for i in range(1500)]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


async def _run(gw: Gateway, rid: str, ids: list[int]) -> tuple[list[int], RequestRecord]:
    record = RequestRecord(rid, len(ids))
    tokens = [e.token_id async for e in gw.stream(GenerateRequest(rid, ids, PARAMS), record)]
    assert record.phase is Phase.FINISHED, record.to_json()
    return tokens, record


async def _until(condition: object, timeout: float, what: str) -> float:
    began = time.monotonic()
    async with asyncio.timeout(timeout):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.05)
    return time.monotonic() - began


def _workers(hosts: NetnsLink, secret: Path, logs: Path) -> dict[str, HandStarted]:
    a, b = hosts.namespaces["a"], hosts.namespaces["b"]
    ctl_a, ctl_b = hosts.root_addresses["a"], hosts.root_addresses["b"]
    common = ["--secret-file", str(secret), "--prefix-cache", "none"]

    def worker(name: str, ns: str, role: str, cluster: str, control: str, kv: str) -> HandStarted:
        argv = ["--role", role, "--cluster", cluster, "--name", name, "--listen", control, "--kv-listen", kv]
        return HandStarted([*argv, *common], logs / f"{name}.log", ["ip", "netns", "exec", ns])

    return {
        "prfaas-p0": worker("prfaas-p0", a, "prefill", "prfaas", f"{ctl_a}:7000", f"{hosts.addresses['a']}:7100"),
        "pd-p0": worker("pd-p0", b, "prefill", "pd", f"{ctl_b}:7001", f"{hosts.addresses['b']}:7101"),
        "pd-d0": worker("pd-d0", b, "decode", "pd", f"{ctl_b}:7002", f"{hosts.addresses['b']}:7102"),
    }


def test_two_hosts_route_stream_over_the_bottleneck_and_survive_faults(tmp_path: Path) -> None:
    rt = ModelRuntime.load("kimi-linear-tiny")
    reference = {"short": reference_tokens(rt, SHORT, PARAMS), "long": reference_tokens(rt, LONG, PARAMS)}
    long_bytes = rt.prefill(LONG).state.nbytes
    secret = write_secret(tmp_path)
    hosts = NetnsLink(rate=RATE, from_root=True)
    workers: dict[str, HandStarted] = {}
    figures: dict[str, object] = {}
    try:
        hosts.__enter__()
        workers = _workers(hosts, secret, tmp_path)
        start_all(list(workers.values()))
        config = ServeConfig(
            model="kimi-linear-tiny",  # what the hand-started workers run
            threshold=THRESHOLD,
            fixed_threshold=True,  # routing stays on length: the rtt the link shows must not move t here
            secret_file=str(secret),
            heartbeat_s=0.5,
            heartbeat_deadline_s=2.0,
            prfaas=ClusterConfig(workers=(f"{hosts.root_addresses['a']}:7000",)),
            pd=ClusterConfig(workers=(f"{hosts.root_addresses['b']}:7001", f"{hosts.root_addresses['b']}:7002")),
            link=InterClusterLinkConfig(rate=RATE),
            cache=CacheConfig(mode="none"),
        )
        asyncio.run(_scenario(config, hosts, workers, reference, long_bytes, figures))
    finally:
        codes = {name: w.stop() for name, w in workers.items()}
        hosts.close()
    print("two hosts:", figures)
    assert all(code == 0 for code in codes.values()), f"workers did not stop cleanly on SIGTERM: {codes}"
    assert not any(alive(w.pid) for w in workers.values() if w.ready)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in hosts.namespaces.values()), listed
    assert "mfr" not in links, links


async def _scenario(
    config: ServeConfig,
    hosts: NetnsLink,
    workers: dict[str, HandStarted],
    reference: dict[str, list[int]],
    long_bytes: int,
    figures: dict[str, object],
) -> None:
    async with Gateway(config) as gw:
        assert not gw.link.emulated
        kv = gw.pool.workers["pd-d0"].kv
        assert kv == (hosts.addresses["b"], 7102)  # its advertised KV address, not the control one

        # short prompts stay local, long ones go PrfaaS, and both equal transformers' own generate()
        crossed = hosts.sent_bytes("a")
        short, rec_s = await _run(gw, "short", SHORT)
        long, rec_l = await _run(gw, "long", LONG)
        assert (rec_s.route, rec_l.route) == ("local", "prfaas")
        assert short == reference["short"] and long == reference["long"]
        # the KV crossed the bottleneck: the PrfaaS host's shaped link sent at least the whole state, as coded
        crossed = hosts.sent_bytes("a") - crossed
        assert rec_l.kv_bytes == long_bytes and 0 < rec_l.kv_wire_bytes <= long_bytes
        assert crossed >= rec_l.kv_wire_bytes, (crossed, rec_l.kv_wire_bytes, rec_l.kv_codec)
        # the scheduler's link health reads the KV connections' rtt from TCP_INFO
        await _until(lambda: gw.scheduler.last is not None and gw.scheduler.last.rtt_ms > 0, 10, "an rtt")
        seen = gw.scheduler.last
        assert seen is not None
        figures.update(
            ttft_local_s=round(rec_s.ttft_s or 0, 3), ttft_prfaas_s=round(rec_l.ttft_s or 0, 3),
            kv_bytes=rec_l.kv_bytes, kv_codec=rec_l.kv_codec, kv_wire_bytes=rec_l.kv_wire_bytes,
            bottleneck_bytes=crossed, transfer_tail_s=rec_l.transfer_s,
            rtt_ms=round(seen.rtt_ms, 3), retrans_rate=seen.retrans_rate,
        )  # fmt: skip
        util = []
        task = asyncio.create_task(_run(gw, "long-2", LONG))
        while not task.done():
            await asyncio.sleep(0.25)
            if gw.scheduler.last is not None:
                util.append(gw.scheduler.last.utilisation)
        tokens, rec = await task
        assert tokens == reference["long"] and rec.route == "prfaas"
        figures["peak_utilisation_seen"] = round(max(util, default=0.0), 2)
        scraped = gw.metrics.exposition().decode()
        assert 'minifaas:link_rtt_seconds{link="prfaas->pd"}' in scraped

        # the PrfaaS worker is killed mid-request: the request falls back to PD-P, and the worker leaves routing
        pid = workers["prfaas-p0"].pid
        task = asyncio.create_task(_run(gw, "killed", LONG))
        await _until(lambda: gw.pool.workers["prfaas-p0"].load_tokens > 0, 30, "the prefill to start")
        workers["prfaas-p0"].process.kill()  # type: ignore[union-attr]
        tokens, rec = await task
        assert tokens == reference["long"] and rec.route == "local" and rec.fallback, rec.to_json()
        assert gw.health()["workers"]["prfaas-p0"] == "down"
        tokens, rec = await _run(gw, "while-down", LONG)  # long, but PrfaaS is down: local, no fallback needed
        assert tokens == reference["long"] and rec.route == "local" and not rec.fallback
        # restarted by whoever runs it (here, the test): the gateway re-attaches as soon as it answers
        workers["prfaas-p0"].start().wait_ready()
        assert workers["prfaas-p0"].pid != pid
        rejoined = await _until(lambda: gw.pool.workers["prfaas-p0"].serving, 60, "rejoin")
        figures["rejoin_after_restart_s"] = round(rejoined, 2)
        tokens, rec = await _run(gw, "after-restart", LONG)
        assert tokens == reference["long"] and rec.route == "prfaas", rec.to_json()

        # a hung worker (SIGSTOP) misses its heartbeats: out of routing within the deadline, back when it answers
        workers["prfaas-p0"].process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        figures["hung_detected_s"] = round(await _until(lambda: not gw.pool.workers["prfaas-p0"].alive, 10, "down"), 2)
        tokens, rec = await _run(gw, "while-hung", LONG)
        assert tokens == reference["long"] and rec.route == "local"
        workers["prfaas-p0"].process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        rejoined = await _until(lambda: gw.pool.workers["prfaas-p0"].serving, 30, "rejoin")
        figures["rejoin_after_hang_s"] = round(rejoined, 2)
        pid = gw.pool.workers["prfaas-p0"].pid
        assert pid == workers["prfaas-p0"].pid  # the same process: re-attached, not replaced
        tokens, rec = await _run(gw, "after-hang", LONG)
        assert tokens == reference["long"] and rec.route == "prfaas"
        assert gw.pool.workers["prfaas-p0"].rejoins == 2
