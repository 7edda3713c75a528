"""Policies by name: every built-in through the plug-in path, one clear line for a bad spec before anything
starts, and a router of one's own obeyed alike by a live gateway (real workers) and by the simulator."""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import replace
from pathlib import Path

import pytest
from policy_probes import OneCluster

from minifaas.cache.pool_config import PoolConfig
from minifaas.commands.main import main
from minifaas.config import CacheConfig, InterClusterLinkConfig, SchedulerConfig, ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, RequestRecord
from minifaas.model.sampling import SamplingParams
from minifaas.planner import LengthDistribution, plan
from minifaas.planner.paper import paper_case
from minifaas.policy import plugin
from minifaas.policy.plugin import KINDS, ROUTER, PolicyError, check_policy, load_policy
from minifaas.policy.router import ClusterView, NodeView, RouteInput, Router, RouterConfig
from minifaas.sim import Simulation, config_for, read_workload
from minifaas.sim.comparison import compare

PROBE = "policy_probes:OneCluster"
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("kind", list(KINDS.values()), ids=list(KINDS))
def test_every_built_in_is_its_class_loads_as_a_plug_in_too_and_has_its_interface(kind: plugin.PolicyKind) -> None:
    for name, (built_in, _) in kind.builtins.items():
        cls = check_policy(name, kind)
        assert cls is built_in  # the name stands for its class, in code
        target = f"{cls.__module__}:{cls.__name__}"
        assert check_policy(target, kind) is cls  # and its module:Class spec loads it through the plug-in path
        for method in kind.methods:  # callers pass the interface's arguments by position
            ours = list(inspect.signature(getattr(cls, method)).parameters.values())
            theirs = inspect.signature(getattr(kind.protocol, method)).parameters
            assert len(ours) >= len(theirs), f"{target}.{method} takes fewer arguments than {kind.protocol}"
            assert all(p.default is not p.empty for p in ours[len(theirs) :]), f"{target}.{method} needs more"


def test_load_policy_builds_a_built_in_and_a_user_class_alike() -> None:
    routing = RouterConfig(cache_affinity=False)
    built_in = load_policy("default", ROUTER, config=routing)
    assert isinstance(built_in, Router) and built_in.config is routing  # the offered keyword it names
    ours = load_policy(PROBE, ROUTER, {"cluster": "pd"}, config=routing)  # it names no config: not given one
    assert isinstance(ours, OneCluster) and ours.cluster == "pd"
    codec = load_policy("lossless", KINDS["codec"])  # a built-in name stands for its arguments too
    assert codec.mode == "lossless"
    snapshots = load_policy("interval", KINDS["snapshot"], {"interval_blocks": 3}, interval_blocks=8)
    assert snapshots.interval_blocks == 3  # an argument wins over the offered keyword of its name


@pytest.mark.parametrize(
    ("spec", "args", "says"),
    [
        ("nosuch.module:Router", {}, "no module named 'nosuch'"),
        ("fancy", {}, "neither a built-in (default) nor module:Class"),
        ("minifaas.policy.router:Nope", {}, "minifaas.policy.router has no class Nope"),
        ("minifaas.policy.short_term:ShortTermPolicy", {}, "not a router policy: ShortTermPolicy has no route()"),
        (PROBE, {}, "missing a required argument: 'cluster'"),
        (PROBE, {"cluster": "pd", "spread": 2}, "unexpected keyword argument 'spread'"),
    ],
)
def test_a_bad_spec_is_one_line_that_says_why(spec: str, args: dict, says: str) -> None:
    with pytest.raises(PolicyError) as raised:
        check_policy(spec, ROUTER, args)
    assert says in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(PolicyError, match="router"):
        ServeConfig(router=spec, router_args=args)  # no gateway can be built from it


def test_a_constructor_that_refuses_its_values_is_a_policy_error_too() -> None:
    with pytest.raises(PolicyError, match="cluster must be prfaas or pd"):
        load_policy(PROBE, ROUTER, {"cluster": "moon"}, config=RouterConfig())


def test_every_policy_key_is_checked_when_the_config_is_made() -> None:
    with pytest.raises(PolicyError, match="snapshot 'sometimes'"):
        CacheConfig(snapshot_policy="sometimes")
    with pytest.raises(PolicyError, match="codec"):
        InterClusterLinkConfig(kv_compression="policy_probes:OneCluster")
    with pytest.raises(PolicyError, match="short_term"):
        SchedulerConfig(short_term="nosuch:Policy")
    with pytest.raises(ValueError, match="profile"):
        SchedulerConfig(long_term="minifaas.policy.long_term:LongTermPolicy")  # re-plans from a profile only


def test_the_toml_keys_and_their_argument_tables(tmp_path: Path) -> None:
    toml = tmp_path / "serve.toml"
    toml.write_text(
        f'[serve]\nrouter = "{PROBE}"\n[serve.router_args]\ncluster = "pd"\n'
        '[cache]\nsnapshot_policy = "minifaas.policy.snapshot_policy:IntervalSnapshots"\n'
        "[cache.snapshot_policy_args]\ninterval_blocks = 2\n"
    )
    config = ServeConfig.from_toml(toml)
    assert (config.router, config.router_args) == (PROBE, (("cluster", "pd"),))
    assert config.cache.snapshot_policy_args == (("interval_blocks", 2),)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--router", "nosuch.module:Router"], "router 'nosuch.module:Router': no module named 'nosuch'"),
        (["--router", PROBE, "--router-arg", "cluster=pd", "--router-arg", "spread=2"], "unexpected keyword"),
        (["--kv-compression", "minifaas.policy.router:Router"], "not a codec policy: Router has no choose()"),
        (["--snapshot-policy", "interval", "--snapshot-policy-arg", "interval_blocks=-1"],
         "snapshot 'interval': ValueError: interval_blocks must be an integer >= 0, got -1"),
        (["--snapshot-policy", "interval", "--snapshot-policy-arg", "interval_blocks=2.5"],
         "interval_blocks must be an integer >= 0, got 2.5"),
        (["--kv-compression", "auto", "--kv-compression-arg", "smoothing=5"],
         "codec 'auto': ValueError: smoothing must be in (0, 1], got 5"),
    ],
)  # fmt: skip
def test_serve_refuses_a_bad_spec_in_one_line_before_anything_starts(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--port", "0", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err and err.count("\n") == 1, err
    assert time.monotonic() - started < 30  # no model loaded, no worker started: the config failed first


def test_a_pool_config_builds_its_snapshot_policy_once_so_a_refused_value_is_its_own_error() -> None:
    with pytest.raises(PolicyError, match="interval_blocks must be an integer >= 0, got -1"):
        PoolConfig("n", 1, snapshot_policy="interval", snapshot_args={"interval_blocks": -1})


def test_sim_takes_the_same_spec_and_compare_runs_two() -> None:
    workload = read_workload("mooncake-synthetic").head(200)
    case = paper_case().with_overrides(lengths=LengthDistribution.empirical("trace", workload.input_tokens))
    base = config_for(case, plan(case).prfaas)
    results = compare({"built-in": base, "pd only": replace(base, router_policy=PROBE, router_args={"cluster": "pd"})},
                      workload)  # fmt: skip
    assert results["built-in"].offload_fraction > 0 and results["pd only"].offload_fraction == 0
    assert results["pd only"].egress_gbps_mean == 0 and results["pd only"].completed == len(workload)


def _shape(seen: list[RouteInput]) -> set[tuple[str, ...]]:
    """What kinds of input a router was shown: the types, the clusters by name, which views hold nodes."""
    return {
        (type(r).__name__, type(r.prfaas).__name__, r.prfaas.name, r.pd.name, type(r.rule).__name__,
         str(bool(r.prfaas.prefill_nodes)), str(bool(r.pd.prefill_nodes)), str(bool(r.pd.decode_nodes)),
         *sorted({type(n).__name__ for c in (r.prfaas, r.pd) for n in (*c.prefill_nodes, *c.decode_nodes)}))
        for r in seen
    }  # fmt: skip


@pytest.mark.slow  # a gateway with real workers
def test_one_router_runs_unchanged_live_and_in_the_simulator() -> None:
    # every prompt is far below t, so the built-in router would keep each on PD-P; the probe offloads them all
    config = ServeConfig(
        model="kimi-linear-tiny", port=0, threshold=10_000, fixed_threshold=True, router=PROBE,
        router_args={"cluster": "prfaas"}, link=InterClusterLinkConfig(rate="100mbit", delay_ms=1.0),
        cache=CacheConfig(block_size=32, snapshot_policy="minifaas.policy.snapshot_policy:IntervalSnapshots",
                          snapshot_policy_args={"interval_blocks": 2}),
    )  # fmt: skip
    prompt = [(7 * i + 3) % 200 for i in range(150)]
    branch = prompt[:140] + [(11 * i + 5) % 200 for i in range(30)]  # shares 140 tokens with the first

    async def live() -> tuple[OneCluster, list[RequestRecord]]:
        async with Gateway(config) as gw:
            records = []
            for i, ids in enumerate([prompt, branch, prompt[:40]]):
                record = RequestRecord(f"r{i}", len(ids))
                tokens = [e.token_id async for e in gw.stream(GenerateRequest(f"r{i}", ids, PARAMS), record)]
                assert len(tokens) == PARAMS.max_tokens
                records.append(record)
            return gw.router, records  # type: ignore[return-value]

    router, records = asyncio.run(live())
    assert isinstance(router, OneCluster) and len(router.seen) == 3
    assert [(r.route, r.prefill_worker) for r in records] == [("prfaas", "prfaas-p0")] * 3
    # the snapshot spec and its argument reached the worker: snapshots every 2 blocks of 32, so the second
    # prompt loads the first's state at 128 (the built-in reuse policy would have kept only its end: none)
    assert [r.cached_tokens for r in records[:2]] == [0, 128]

    workload = read_workload("mooncake-synthetic").head(300)
    case = paper_case().with_overrides(lengths=LengthDistribution.empirical("trace", workload.input_tokens))
    sim_config = config_for(case, plan(case).prfaas)
    simulation = Simulation(replace(sim_config, router_policy=PROBE, router_args={"cluster": "prfaas"}), workload)
    result = simulation.run()
    assert isinstance(simulation.router, OneCluster) and len(simulation.router.seen) == len(workload)
    assert result.offload_fraction == 1.0 and result.completed == len(workload)  # obeyed: every prompt offloaded
    assert _shape(simulation.router.seen) == _shape(router.seen)  # the same kinds of input, live and simulated
    assert all(isinstance(n, NodeView) for r in router.seen for n in r.pd.decode_nodes)
    assert all(isinstance(r.prfaas, ClusterView) for r in simulation.router.seen)
