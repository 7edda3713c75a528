"""Workers as Ray actors on a real two-node Ray cluster, one custom resource per node.

``ray.cluster_utils.Cluster`` starts a head node holding the ``pd`` resource and
a second node holding ``prfaas``, as two Raylets on this machine. The gateway
places each worker with ``--launcher ray``; a killed actor is restarted by Ray
and the gateway attaches to it again.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minifaas.config import CacheConfig, ClusterConfig, InterClusterLinkConfig, RayConfig, ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.model.reference import reference_tokens
from minifaas.model.runtime import ModelRuntime
from minifaas.model.sampling import SamplingParams

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow
SHORT = [(7 * i) % 256 for i in range(40)]
LONG = [(13 * i + 5) % 256 for i in range(700)]
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


async def _run(gw: Gateway, rid: str, ids: list[int]) -> tuple[list[int], RequestRecord]:
    record = RequestRecord(rid, len(ids))
    return [e.token_id async for e in gw.stream(GenerateRequest(rid, ids, PARAMS), record)], record


def test_serve_without_a_ray_cluster_to_join_says_so_in_one_line(tmp_path: Path) -> None:
    """Before this file's cluster starts, none runs here: serve --launcher ray stops with code 1 and says how to
    start one, where Ray's own error was a traceback."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(tmp_path)}
    argv = [sys.executable, "-m", "minifaas.commands.main", "serve", "--launcher", "ray", "--port", "0", "--model",
            "kimi-linear-tiny"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    said = "minifaas serve: no Ray cluster at 'auto'"
    assert done.returncode == 1 and said in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_workers_land_on_their_clusters_nodes_and_a_killed_actor_comes_back() -> None:
    rt = ModelRuntime.load("kimi-linear-tiny")
    reference = {"short": reference_tokens(rt, SHORT, PARAMS), "long": reference_tokens(rt, LONG, PARAMS)}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"pd": 2}})
    cluster.add_node(num_cpus=1, resources={"prfaas": 1})
    ray.init(address=cluster.address)  # the gateway shares this driver, so the test can look at its actors
    config = ServeConfig(
        model="kimi-linear-tiny",  # the model the expected tokens come from
        threshold=200,
        fixed_threshold=True,
        launcher="ray",
        ray=RayConfig(address=cluster.address, start_timeout=240),
        prfaas=ClusterConfig(prefill_workers=1),
        pd=ClusterConfig(prefill_workers=1, decode_workers=1),
        link=InterClusterLinkConfig(rate="none"),
        cache=CacheConfig(mode="none"),
        heartbeat_s=0.5,
        heartbeat_deadline_s=3.0,
    )
    try:
        cluster.wait_for_nodes()
        asyncio.run(_scenario(config, reference))
        for name in ("prfaas-p0", "pd-p0", "pd-d0"):  # every actor ended with the gateway
            with pytest.raises(ValueError):
                ray.get_actor(name)
        assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
    finally:
        ray.shutdown()
        cluster.shutdown()


async def _scenario(config: ServeConfig, reference: dict[str, list[int]]) -> None:
    began = time.monotonic()
    async with Gateway(config) as gw:
        print(f"ray: gateway ready in {time.monotonic() - began:.1f} s")
        resources = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        for w in gw.pool.workers.values():  # each actor on a node that holds its cluster's resource
            node = await gw.launcher.actors[w.spec.name].node.remote()  # type: ignore[attr-defined]
            assert w.cluster in resources[node], (w.name, resources)
        assert not gw.link.emulated
        short, rec_s = await _run(gw, "short", SHORT)
        long, rec_l = await _run(gw, "long", LONG)
        assert (rec_s.route, rec_l.route) == ("local", "prfaas") and short == reference["short"]
        assert long == reference["long"]

        # Ray restarts a killed actor; the gateway attaches to the new one, and requests go on meanwhile
        old_pid = gw.pool.workers["prfaas-p0"].pid
        ray.kill(gw.launcher.actors["prfaas-p0"], no_restart=False)
        async with asyncio.timeout(30):
            while gw.pool.workers["prfaas-p0"].alive:
                await asyncio.sleep(0.05)
        asked = time.monotonic()  # how its process ended is not this process's to see: not waited for
        assert await gw.pool.ended_by_itself("prfaas-p0", old_pid) and time.monotonic() - asked < 0.5
        tokens, rec = await _run(gw, "meanwhile", LONG)
        assert tokens == reference["long"] and rec.route == "local"
        began = time.monotonic()
        async with asyncio.timeout(240):
            while not gw.pool.workers["prfaas-p0"].serving:
                await asyncio.sleep(0.2)
        print(f"ray: restarted actor re-attached {time.monotonic() - began:.1f} s after the request")
        assert gw.pool.workers["prfaas-p0"].pid != old_pid and gw.pool.workers["prfaas-p0"].rejoins == 1
        tokens, rec = await _run(gw, "after", LONG)
        assert tokens == reference["long"] and rec.route == "prfaas", rec.to_json()
