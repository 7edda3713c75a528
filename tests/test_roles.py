"""PD workers change role while the gateway serves: drained, restarted in the other role, and rejoined.

Real worker processes and link emulators throughout; requests keep arriving
during every conversion, and none may fail or come back short.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from minifaas.commands.main import command_parser
from minifaas.commands.serve import config_from_args
from minifaas.config import CacheConfig, ClusterConfig, InterClusterLinkConfig, SchedulerConfig, ServeConfig
from minifaas.gateway.gateway import Gateway
from minifaas.gateway.requests import GenerateRequest, Phase, RequestRecord
from minifaas.gateway.roles import RoleChanger
from minifaas.launch.worker_specs import worker_argv
from minifaas.model.sampling import SamplingParams
from minifaas.planner.profile import DecodeProfile, PrefillProfile, ProfilePoint, save_profiles

pytestmark = pytest.mark.slow  # gateways whose workers change role under load

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LENGTHS = (40, 300, 90, 520)  # short ones stay local, long ones go PrfaaS at t = 256


def _config(**changes: object) -> ServeConfig:
    base = ServeConfig(
        threshold=256,
        fixed_threshold=True,
        prfaas=ClusterConfig(prefill_workers=1),
        pd=ClusterConfig(prefill_workers=1, decode_workers=2),
        link=InterClusterLinkConfig(rate="200mbit", delay_ms=1.0),
        cache=CacheConfig(mode="none"),
    )
    return replace(base, **changes)


async def _run(gw: Gateway, rid: str, n: int, params: SamplingParams = GREEDY) -> tuple[RequestRecord, list[int]]:
    prompt = [(n * 13 + 5 * i) % 256 for i in range(n)]
    record = RequestRecord(rid, n)
    tokens = [e.token_id async for e in gw.stream(GenerateRequest(rid, prompt, params), record)]
    return record, tokens


async def _client(gw: Gateway, name: str, stop: asyncio.Event, done: list) -> None:
    i = 0
    while not stop.is_set():
        n = LENGTHS[(i + len(name)) % len(LENGTHS)]
        done.append(await _run(gw, f"{name}-{i}", n))
        i += 1


def _roles(gw: Gateway) -> dict[str, str]:
    return {name: w.role for name, w in gw.pool.workers.items() if w.cluster == "pd"}


def test_workers_change_role_under_load_and_no_request_fails() -> None:
    async def scenario() -> None:
        async with Gateway(_config()) as gw:
            reference = {n: (await _run(gw, f"ref-{n}", n))[1] for n in LENGTHS}
            done: list[tuple[RequestRecord, list[int]]] = []
            stop = asyncio.Event()
            async with asyncio.TaskGroup() as clients:
                for name in ("a", "bb", "ccc"):
                    clients.create_task(_client(gw, name, stop, done))
                # decode -> prefill, prefill -> decode, then the last original decode worker -> prefill
                for old, role, new in (("pd-d1", "prefill", "pd-p1"), ("pd-p0", "decode", "pd-d2"),
                                       ("pd-d0", "prefill", "pd-p2")):  # fmt: skip
                    async with asyncio.timeout(240):
                        replaced = await gw.roles.start(gw.pool.workers[old], role)
                    assert replaced is not None and replaced.name == new and old not in gw.pool.workers
                    assert gw.pool.workers[new].role == role and gw.pool.workers[new].serving
                    assert gw.health()["workers"][new] == "up"
                settled = len(done)
                async with asyncio.timeout(240):
                    while len(done) < settled + 6:  # requests served wholly by the new split
                        await asyncio.sleep(0.2)
                stop.set()

            assert _roles(gw) == {"pd-p1": "prefill", "pd-p2": "prefill", "pd-d2": "decode"}
            assert gw.roles.counts == {"to_prefill": 2, "to_decode": 1}
            assert set(gw.link.routes) == {"pd-d2"}  # each retired decode worker's route is gone
            assert list((await gw.link.control.stats())["routes"].values()) == [
                f"127.0.0.1:{gw.pool.workers['pd-d2'].kv[1]}"
            ]
            assert set(gw.prefixes.indexes) == set(gw.pool.workers)
            # zero failures: every request finished with every token, and the same tokens as before
            for record, tokens in done:
                assert record.phase is Phase.FINISHED and not record.fallback, record.to_json()
                assert tokens == reference[record.prompt_tokens], record.to_json()
            after = [r for r, _ in done[settled:]]
            assert all(r.decode_worker == "pd-d2" for r in after)
            assert {r.prefill_worker for r in after if r.route == "local"} <= {"pd-p1", "pd-p2"}
            assert {r.route for r, _ in done} == {"local", "prfaas"}
            assert [c.new for c in gw.roles.done] == ["pd-p1", "pd-d2", "pd-p2"]
            scraped = gw.metrics.exposition().decode()
            assert 'minifaas:role_changes_total{outcome="done",to="prefill"} 2.0' in scraped

    asyncio.run(scenario())


def test_a_drain_that_times_out_keeps_the_worker_in_its_role() -> None:
    config = _config(scheduler=SchedulerConfig(drain_timeout=0.5))
    long = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    async def scenario() -> None:
        async with Gateway(config) as gw:
            record = RequestRecord("long", 60)
            prompt = [(7 * i) % 256 for i in range(60)]
            stream = gw.stream(GenerateRequest("long", prompt, long), record)
            tokens = [(await anext(stream)).token_id]
            holder = gw.pool.workers[record.decode_worker]  # type: ignore[index]
            conversion = gw.roles.start(holder, "prefill")
            assert not holder.serving  # draining: routed nothing new
            assert await conversion is None
            assert holder.serving and holder.role == "decode" and gw.roles.counts["abandoned"] == 1
            assert (
                'minifaas:role_changes_total{outcome="abandoned",to="prefill"} 1.0' in gw.metrics.exposition().decode()
            )
            tokens += [e.token_id async for e in stream]
            assert len(tokens) == 48 and record.phase is Phase.FINISHED

    asyncio.run(scenario())


def test_conversions_that_would_empty_a_stage_are_refused_and_pd_prefill_waits_are_signalled() -> None:
    async def scenario() -> None:
        async with Gateway(_config(prfaas=ClusterConfig(prefill_workers=0))) as gw:
            changer: RoleChanger = gw.roles
            assert changer.pick(to_prefill=True).name in ("pd-d0", "pd-d1")  # type: ignore[union-attr]
            assert changer.pick(to_prefill=False) is None  # the only prefill worker, and no PrfaaS
            with pytest.raises(ValueError, match="cannot become"):
                changer.start(gw.pool.workers["pd-d0"], "decode")
            gw.roles.rebalance(-1)
            assert changer.counts["refused"] == 1 and not changer.tasks
            # the scheduler's wait signal at PD-P: queued prompt tokens over the measured prefill speed
            await _run(gw, "warm", 200)
            assert gw.scheduler.speed["pd"] > 0 and gw.scheduler.signals(0.0).pd_prefill.wait_s == 0
            long = asyncio.create_task(_run(gw, "long", 1500))
            async with asyncio.timeout(60):
                while not gw.pool.workers["pd-p0"].load_tokens:
                    await asyncio.sleep(0.01)
            signals = gw.scheduler.signals(0.0)
            assert signals.pd_prefill.wait_s == pytest.approx(1500 / gw.scheduler.speed["pd"])
            rows = [w.max_batch for w in gw.pool.of("pd", "decode")]  # as each worker sized its batch
            assert len(rows) == 2 and min(rows) >= 256
            assert signals.decode_occupancy == pytest.approx(1 / sum(rows))  # one request in all their rows
            await long

    asyncio.run(scenario())


def test_the_long_term_policy_re_roles_a_worker_when_its_plan_says_so(tmp_path: Path) -> None:
    # A profile of an instance whose decode is far faster than its prefill: the planner wants
    # one more PD-P worker than the 1 prefill / 2 decode the cluster starts with.
    points = tuple(ProfilePoint(n, n * 1e-3, 640.0 * n + 135_168) for n in (64, 256, 1024))
    profile = tmp_path / "profile.json"
    save_profiles(profile, PrefillProfile("slow prefill", 1, points), DecodeProfile("fast decode", 1, 256, 0.005))
    scheduler = SchedulerConfig(profile=str(profile), period_s=2.0, min_requests=6)
    link = InterClusterLinkConfig(rate="20mbit", delay_ms=1.0)
    config = _config(fixed_threshold=False, link=link, scheduler=scheduler)

    async def scenario() -> None:
        async with Gateway(config) as gw:
            done: list[tuple[RequestRecord, list[int]]] = []
            stop = asyncio.Event()
            async with asyncio.TaskGroup() as clients:
                for name in ("a", "bb"):
                    clients.create_task(_client(gw, name, stop, done))
                async with asyncio.timeout(300):
                    while not gw.roles.done:
                        await asyncio.sleep(0.2)
                stop.set()
            plans = gw.scheduler.long.decisions  # type: ignore[union-attr]
            assert any(p.to_prefill == 1 for p in plans), plans
            assert gw.scheduler.short.base == plans[-1].threshold  # a converting plan's t, once its worker joined
            assert sorted(_roles(gw).values()) == ["decode", "prefill", "prefill"]
            for record, tokens in done:
                assert record.phase is Phase.FINISHED and len(tokens) == GREEDY.max_tokens, record.to_json()
            scraped = gw.metrics.exposition().decode()
            assert 'policy="long_term",reason="convert"' in scraped

    asyncio.run(scenario())


def test_each_role_gets_its_command_line_and_prefill_chunks_follow_the_cluster() -> None:
    config = _config(pd=ClusterConfig(prefill_workers=1, decode_workers=2, prefill_chunk=0, max_batch=4))
    pd_prefill = worker_argv(config, "prefill", "pd")
    assert pd_prefill[pd_prefill.index("--prefill-chunk") + 1] == "0" and "--max-batch" not in pd_prefill
    prfaas = worker_argv(config, "prefill", "prfaas")
    assert prfaas[prfaas.index("--prefill-chunk") + 1] == "512"
    decode = worker_argv(config, "decode", "pd")
    assert decode[decode.index("--max-batch") + 1] == "4" and "--prefill-chunk" not in decode
    with pytest.raises(ValueError, match="prefill_chunk"):
        ClusterConfig(prefill_chunk=-1)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_dtype_and_remote_code_reach_every_worker_per_cluster(tmp_path: Path) -> None:
    config = _config(trust_remote_code=True)
    for role, cluster in (("prefill", "prfaas"), ("prefill", "pd"), ("decode", "pd")):
        argv = worker_argv(config, role, cluster)
        assert _flag(argv, "--dtype") == "float32" and "--trust-remote-code" in argv  # auto on a CPU
    assert "--trust-remote-code" not in worker_argv(_config(), "decode", "pd")
    on_gpu = _config(prfaas=ClusterConfig(device="cuda:0"), pd=ClusterConfig(1, 1, device="cuda:1"))
    assert {_flag(worker_argv(on_gpu, r, c), "--dtype") for r, c in (("prefill", "prfaas"), ("decode", "pd"))} == {
        "bfloat16"
    }
    with pytest.raises(ValueError, match="PrfaaS cluster would run bfloat16 and the PD cluster float32"):
        _config(prfaas=ClusterConfig(device="cuda:0"))
    toml = tmp_path / "serve.toml"
    toml.write_text('[serve]\ndtype = "float16"\ntrust_remote_code = true\n[pd]\ndecode_workers = 1\n'
                    '[prfaas]\nprefill_workers = 0\n[link]\nrate = "none"\n')  # fmt: skip
    loaded = ServeConfig.from_toml(toml)
    assert loaded.trust_remote_code and _flag(worker_argv(loaded, "decode", "pd"), "--dtype") == "float16"
    toml.write_text('[pd]\ndecode_workers = 1\ndtype = "bfloat16"\n[prfaas]\nprefill_workers = 0\n')
    assert _flag(worker_argv(ServeConfig.from_toml(toml), "prefill", "pd"), "--dtype") == "bfloat16"
    flags = command_parser("serve").parse_args(["--config", str(toml), "--dtype", "float16", "--trust-remote-code"])
    from_flags = config_from_args(flags)  # a flag wins over the file, for every cluster
    assert from_flags.pd.dtype is None and from_flags.worker_dtype("pd") == "float16" and from_flags.trust_remote_code
    with pytest.raises(ValueError, match="dtype must be one of"):
        ClusterConfig(dtype="fp8")
