"""The simulator end to end: agreement with the planner, cache replay, latency, link behaviour, CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest

from minifaas.commands.main import main
from minifaas.commands.sim import scaled_case
from minifaas.planner import LengthDistribution, OperatingPoint, PlanCase, plan
from minifaas.planner.paper import paper_case
from minifaas.planner.profile import DecodeProfile, PrefillProfile, ProfilePoint, save_profiles
from minifaas.policy.router import RouteReason
from minifaas.sim.arrivals import ArrivalKind, ArrivalSpec
from minifaas.sim.deployment import NO_OFFLOAD, config_for
from minifaas.sim.fluid_link import LinkConfig
from minifaas.sim.prefix import ClusterPrefixCaches
from minifaas.sim.simulator import PD, PRFAAS, Simulation
from minifaas.sim.workload import Workload, read_workload, synthetic


def simulated_throughput(case: PlanCase, point: OperatingPoint, load: float, seed: int = 0) -> float:
    """Req/s the simulator serves with uniform arrivals at ``load`` x the planned capacity, no prefix reuse."""
    link = LinkConfig(case.link_gbps, rtt_s=0.01, pipeline_layers=61)
    config = config_for(case, point, link, warmup_s=400.0, drain=False)
    arrivals = ArrivalSpec(ArrivalKind.UNIFORM, load * point.throughput_rps)
    workload = synthetic(case.lengths, round(case.output_tokens), arrivals, 3_000.0, seed)
    return Simulation(config, workload).run().throughput_rps


def other_case() -> PlanCase:
    """Different sizes, lengths and outputs: a heavier-tailed prompt mix and short answers."""
    return paper_case().with_overrides(
        name="wide",
        n_prfaas=2,
        n_pd=10,
        n_homogeneous=12,
        output_tokens=256.0,
        lengths=LengthDistribution.lognormal(mu=9.0, sigma=1.3, low=64, high=100_000),
    )


@pytest.mark.parametrize(
    ("label", "case", "config_name"),
    [
        ("paper, PrfaaS", paper_case(), "prfaas"),
        ("paper, homogeneous", paper_case(), "homogeneous"),
        ("paper, naive", paper_case(), "naive"),
        ("paper at 4 Gbps: link-bound", paper_case().with_overrides(link_gbps=4.0), "prfaas"),
        ("wide lengths, short outputs", other_case(), "prfaas"),
    ],
)
def test_simulator_at_saturation_agrees_with_the_planner(label: str, case: PlanCase, config_name: str) -> None:
    """Saturation throughput is bracketed from both sides: the simulated deployment sustains the
    planned rate (no more than 5% falls behind), and 30% overload gets no more than 5% above it."""
    point = getattr(plan(case), config_name)
    assert simulated_throughput(case, point, 1.0) >= 0.95 * point.throughput_rps, label
    assert simulated_throughput(case, point, 1.3) <= 1.05 * point.throughput_rps, label


def test_link_bound_case_is_really_link_bound() -> None:  # the case above would not test the link otherwise
    assert plan(paper_case().with_overrides(link_gbps=4.0)).prfaas.bottleneck == "prfaas-link"


def direct_prefix_hits(workload: Workload) -> float:
    """Hit tokens / prompt tokens if every earlier prompt's full blocks were cached: a count over hash ids."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    block = workload.block_tokens
    for prompt, ids in zip(workload.input_tokens.tolist(), workload.hash_ids, strict=True):
        matched = 0
        while matched < len(ids) and tuple(ids[: matched + 1]) in seen:
            matched += 1
        hit += min(matched, (prompt - 1) // block) * block  # at least one token is computed
        total += prompt
        seen.update(tuple(ids[: j + 1]) for j in range(prompt // block))  # only full blocks are cached
    return hit / total


def test_infinite_cache_replay_matches_a_direct_count_of_hash_ids() -> None:
    trace = read_workload("mooncake-synthetic").head(1_500)
    spaced = replace(trace, arrival_s=np.arange(len(trace)) * 100.0)  # one at a time: all earlier prompts cached
    case = paper_case()
    config = config_for(case, plan(case).homogeneous, snapshot_interval_blocks=1)
    result = Simulation(config, spaced).run()
    expected = direct_prefix_hits(spaced)
    assert expected > 0.15  # the trace does share prefixes
    assert result.prefix_hit_token_ratio == pytest.approx(expected, rel=1e-9)
    sparse = Simulation(replace(config, snapshot_interval_blocks=8), spaced).run().prefix_hit_token_ratio
    assert sparse < expected  # linear state is reusable only where a snapshot exists


def prompts_of(*hash_ids: tuple[int, ...]) -> Workload:
    """Prompts of whole 512-token blocks, one every 100 s: each finds every earlier one cached."""
    n = len(hash_ids)
    inputs = np.array([512 * len(ids) for ids in hash_ids])
    return Workload("prompts", np.arange(n) * 100.0, inputs, np.full(n, 4), tuple(hash_ids), 512)


def test_a_repeated_prompt_is_served_whole_from_its_end_snapshot() -> None:
    case = paper_case()
    config = config_for(case, plan(case).homogeneous, snapshot_policy="reuse", early_first_token=True)
    workload = prompts_of((1, 2, 3, 4), (1, 2, 3, 4))
    whole = Simulation(replace(config, whole_prompt_hits=True), workload)
    result = whole.run()
    assert result.prefix_hit_token_ratio == 0.5  # the second prompt, all of it
    second_ttft = whole.first_token[1] - 100.0
    assert second_ttft == pytest.approx(float(case.pd_prefill.latency_s(1)), rel=1e-9)  # nothing to compute
    capped = Simulation(config, workload).run()
    assert capped.prefix_hit_token_ratio == 0.0  # a hit must leave a token, and no snapshot lies below the end


def test_a_prompt_whose_state_moved_in_is_not_served_whole() -> None:
    caches = ClusterPrefixCaches(("prfaas", "pd"), 512, float("inf"), paper_case().prfaas)
    keys = caches.keys((1, 2, 3, 4), 2048)
    caches.store("prfaas", keys, 0.0)
    caches.store_received("pd", keys, 1.0)  # the end state crossed the link without the logits
    assert caches.holds_whole("prfaas", keys) and not caches.holds_whole("pd", keys)
    assert caches.match(keys)["pd"].kv_prefix_tokens == 2047  # its KV is there all the same (a match leaves a token)


def test_the_reuse_snapshot_policy_keeps_the_branch_point_a_third_prompt_loads() -> None:
    case = paper_case()
    config = config_for(case, plan(case).homogeneous, snapshot_policy="reuse")
    sim = Simulation(config, prompts_of((1, 2, 3, 4), (1, 2, 5, 6), (1, 2, 7, 8)))
    result = sim.run()
    # the second prompt finds two blocks stored and keeps its state there; the third loads them
    assert sim.cached_tokens == 1024
    assert result.prefix_hit_token_ratio == pytest.approx(1024 / (3 * 2048))


def test_ttft_at_light_load_is_prefill_plus_one_step() -> None:
    case = paper_case()
    config = config_for(case, plan(case).homogeneous)
    workload = synthetic(case.lengths, 1024, ArrivalSpec(ArrivalKind.UNIFORM, 0.05), 2_000.0, seed=4)
    result = Simulation(config, workload).run()
    expected = case.pd_prefill.latency_s(workload.input_tokens) + case.decode.step_time_s
    assert result.ttft_mean_s == pytest.approx(float(expected.mean()), rel=1e-9)
    assert result.offload_fraction == 0.0 and result.egress_gbps_mean == 0.0
    delivered = Simulation(replace(config, delivery_s=0.01), workload)
    late = delivered.run()  # every token 10 ms later at the client, the deployment's work unchanged
    assert late.ttft_mean_s == pytest.approx(result.ttft_mean_s + 0.01, rel=1e-9)


def test_a_prefill_queued_behind_another_waits_the_workers_turnaround_too() -> None:
    case = paper_case()
    config = replace(config_for(case, plan(case).homogeneous), n_prefill=1, prefix_cache=False)
    burst = Workload("burst", np.zeros(3), np.full(3, 2048), np.full(3, 4), None, 512)  # three at once, one node
    light = synthetic(case.lengths, 256, ArrivalSpec(ArrivalKind.UNIFORM, 0.05), 2_000.0, seed=4)
    turn = 0.01
    for workload, waits in ((burst, [0, 1, 2]), (light, [0] * len(light))):
        plain = Simulation(config, workload)
        plain.run()
        turning = Simulation(replace(config, prefill_turnaround_s=turn), workload)
        turning.run()
        late = np.array(turning.first_token) - np.array(plain.first_token)
        assert late == pytest.approx(turn * np.array(waits), abs=1e-9)  # one turnaround per forward ahead


def test_an_early_first_token_comes_at_the_prefill_end_and_decode_makes_the_rest() -> None:
    case = paper_case()
    link = LinkConfig(gbps=2.0, rtt_s=0.2)  # a slow link: the KV lands seconds after an offloaded prefill ends
    config = replace(config_for(case, plan(case).prfaas, link), early_first_token=True)
    workload = synthetic(case.lengths, 64, ArrivalSpec(ArrivalKind.UNIFORM, 0.05), 2_000.0, seed=4)
    early = Simulation(config, workload).run()
    late = Simulation(replace(config, early_first_token=False), workload).run()
    long = workload.input_tokens > config.threshold
    prefill = np.where(
        long, case.prfaas.latency_s(workload.input_tokens), case.pd_prefill.latency_s(workload.input_tokens)
    )
    assert 0 < early.offload_fraction < 1
    assert early.ttft_mean_s == pytest.approx(float(prefill.mean()), rel=1e-9)  # nothing queues at this load
    assert late.ttft_prfaas_mean_s > early.ttft_prfaas_mean_s + 1.0  # the transfer, RTT/2 and one step
    assert late.ttft_pd_mean_s == pytest.approx(early.ttft_pd_mean_s + case.decode.step_time_s, rel=1e-9)
    assert early.completed == late.completed == len(workload)


def offloaded_ttft(link: LinkConfig) -> float:
    case = paper_case()
    config = replace(config_for(case, plan(case).prfaas, link), threshold=0, n_prefill=1)
    workload = synthetic(case.lengths, 64, ArrivalSpec(ArrivalKind.UNIFORM, 0.05), 2_000.0, seed=5)
    return Simulation(config, workload).run().ttft_prfaas_mean_s


def test_layer_pipelining_hides_transfer_and_rtt_adds_half_a_round_trip() -> None:
    slow = LinkConfig(gbps=2.0)
    off, on = offloaded_ttft(slow), offloaded_ttft(replace(slow, pipeline_layers=61))
    assert on < off - 0.5  # at 2 Gbps a mean prompt's KV takes seconds: pipelining hides most of it
    with_rtt = offloaded_ttft(replace(slow, rtt_s=0.2))
    assert with_rtt == pytest.approx(off + 0.1, abs=1e-6)


def test_on_shared_cores_an_offloaded_prompt_decodes_only_after_its_prefill_however_it_slows() -> None:
    # a fast pipelined link brings the KV before the prefill ends; prefills that start later then slow it
    case = paper_case()
    link = LinkConfig(gbps=400.0, pipeline_layers=61)
    config = replace(config_for(case, plan(case).prfaas, link, early_first_token=True), threshold=0)
    workload = synthetic(case.lengths, 8, ArrivalSpec(ArrivalKind.POISSON, 2.0), 120.0, seed=8)
    sim = Simulation(replace(config, shared_cores=2, contention=(1.0, 1.5)), workload)
    sim.run()
    first, finished = np.array(sim.first_token), np.array(sim.finished)  # first: the prefill's end
    assert not np.isnan(finished).any()
    assert np.all(finished - first >= 7 * case.decode.step_time_s * (1 - 1e-9))  # seven steps after it, at least


def test_a_link_cut_holds_offloaded_kv_until_it_returns() -> None:
    case = paper_case()
    link = LinkConfig(gbps=100.0, schedule=((100.0, 0.0), (400.0, 100.0)))
    config = replace(config_for(case, plan(case).prfaas, link), threshold=0, n_prefill=1)
    workload = synthetic(case.lengths, 64, ArrivalSpec(ArrivalKind.UNIFORM, 0.5), 600.0, seed=6)
    sim = Simulation(config, workload)
    sim.run()
    first = np.array(sim.first_token)
    during = (workload.arrival_s > 110.0) & (workload.arrival_s < 390.0)
    assert np.all(first[during] >= 400.0)
    after = workload.arrival_s > 420.0
    assert np.all(first[after] - workload.arrival_s[after] < 30.0)  # back to normal once the backlog is gone


def test_with_a_bound_on_the_links_backlog_long_prompts_stay_local_through_a_cut() -> None:
    """As the gateway routes: the state routed across the link counts until it has crossed."""
    case = paper_case()
    link = LinkConfig(gbps=100.0, schedule=((100.0, 0.0), (400.0, 100.0)))
    config = replace(config_for(case, plan(case).prfaas, link), threshold=0, n_prefill=1)
    config = replace(config, router=replace(config.router, max_link_backlog_s=5.0))
    workload = synthetic(case.lengths, 64, ArrivalSpec(ArrivalKind.UNIFORM, 0.5), 600.0, seed=6)
    sim = Simulation(config, workload)
    sim.run()
    during = (workload.arrival_s > 110.0) & (workload.arrival_s < 390.0)
    assert np.all(np.array(sim.path)[during] == PD)  # the few routed across before the cut hold the link "full"
    assert sim.router.reasons[RouteReason.LONG_BUT_LINK_FULL] >= during.sum()
    assert np.all(np.array(sim.path)[workload.arrival_s > 420.0] == PRFAAS)  # back once their state has crossed
    assert sim._link_committed == pytest.approx(0.0, abs=1.0)


def test_a_link_cut_for_good_ends_the_run_with_the_offloaded_requests_unfinished() -> None:
    case = paper_case()
    link = LinkConfig(gbps=100.0, schedule=((100.0, 0.0),))  # never back
    config = replace(config_for(case, plan(case).prfaas, link), threshold=0, n_prefill=1)
    workload = synthetic(case.lengths, 64, ArrivalSpec(ArrivalKind.UNIFORM, 0.5), 300.0, seed=6)
    sim = Simulation(config, workload)
    result = sim.run()  # draining: it ends once no event is left that could finish the rest
    finished = ~np.isnan(np.array(sim.finished))
    before = workload.arrival_s < 90.0
    assert finished[before].all() and 0 < result.completed < result.requests
    assert not finished[workload.arrival_s > 110.0].any()  # every later one crosses the link (threshold 0)


def test_a_run_with_offloads_late_in_simulated_time_ends() -> None:
    case = paper_case()
    config = replace(config_for(case, plan(case).prfaas, LinkConfig(100.0)), threshold=0)
    n = 8
    workload = Workload("late", 40_000.0 + 997.0 * np.arange(n), np.full(n, 30_000), np.full(n, 4))
    ticks: list[float] = []

    def tick(now: float) -> None:  # every 50,000 events: a few for samples, more is a loop that never ends
        ticks.append(now)
        if len(ticks) > 4:
            raise RuntimeError(f"no end in sight at {now} s")

    result = Simulation(config, workload).run(progress=tick)
    assert result.completed == n and result.offload_fraction == 1.0


def test_sim_says_when_a_drained_run_leaves_requests_unfinished(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--duration", "30", "--bandwidth-schedule", "10:0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^[\d,]+ requests never finished: no event was left to move them", out, re.M), out


@pytest.mark.parametrize(
    ("name", "rows", "says"),
    [
        ("t.jsonl", '{"timestamp": 0, "input_length": -100, "output_length": 10}\n', "request 1 has -100 prompt"),
        ("t.jsonl", '{"timestamp": 0, "input_length": 9, "output_length": 4}\n' * 2
         + '{"timestamp": 5, "input_length": 9, "output_length": 0}\n', "request 3 has 9 prompt and 0 output"),
        ("t.jsonl", "\n", "t.jsonl: no requests in the trace"),
        ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,0,5\n",
         "request 1 has 0 prompt"),
        ("t.jsonl", '{"timestamp": 0, "input_length": 9, "output_length": 4}\nnot json\n', "t.jsonl line 2: not JSON"),
        ("t.jsonl", '{"timestamp": 0, "input_length": 9}\n', "t.jsonl line 1: no 'output_length'"),
        ("t.jsonl", "[1, 2]\n", "t.jsonl line 1: not a JSON object"),
        ("t.jsonl", '{"timestamp": 0, "input_length": 9, "output_length": 4, "hash_ids": [1]}\n'
         '{"timestamp": 1, "input_length": 9, "output_length": 4}\n', "line 1 has hash_ids and line 2 has none"),
        ("t.jsonl", '{"timestamp": NaN, "input_length": 9, "output_length": 4}\n', "request 1 has no finite timestamp"),
        ("t.jsonl", '{"timestamp": 0, "input_length": 100000, "output_length": 4, "hash_ids": [1]}\n',
         "t.jsonl line 1: 100000 prompt tokens need 196 hash_ids of 512 tokens, not 1"),
        ("t.jsonl", '{"timestamp": 0, "input_length": 100, "output_length": 4, "hash_ids": [1, 2]}\n',
         "t.jsonl line 1: 100 prompt tokens need 1 hash_ids of 512 tokens, not 2"),
        ("t.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,5\n", "t.csv line 2: no 'GeneratedTokens'"),
        ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n", "t.csv line 2: Invalid isoformat"),
        ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5e3,5,5\n",
         "t.csv line 2: the fraction of a second '5e3' is not digits"),
        ("t.jsonl", b"\xff\xfe{}\n", "t.jsonl: not UTF-8 text (byte 0xff: invalid start byte)"),
        ("t.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5,\xe9\n",
         "t.csv: not UTF-8 text (byte 0xe9: invalid continuation byte)"),
    ],
)  # fmt: skip
def test_a_bad_trace_row_or_no_row_is_one_error_line_naming_it(
    tmp_path, capsys: pytest.CaptureFixture[str], name: str, rows: str | bytes, says: str
) -> None:
    path = tmp_path / name
    path.write_bytes(rows) if isinstance(rows, bytes) else path.write_text(rows)
    with pytest.raises(SystemExit) as stopped:
        main(["sim", "--trace", str(path)])
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err


def test_a_mooncake_trace_without_hash_ids_keeps_its_lengths_and_runs_without_prefix_matching(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    rows = [(0, 1000), (2000, 20000), (5000, 50000)]
    path.write_text(
        "".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 5}) + "\n" for t, n in rows)
    )
    workload = read_workload(str(path))
    assert workload.input_tokens.tolist() == [1000, 20000, 50000] and workload.hash_ids is None
    assert main(["sim", "--case", "paper", "--trace", str(path), "--json", "--no-progress"]) == 0  # the cache on
    assert json.loads(capsys.readouterr().out)["completed"] == 3


def test_azure_timestamps_are_utc_whatever_the_machines_time_zone(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.csv"  # a minute apart; in New York's local time, the hour its clocks went back
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-05 01:59:00.5000000,1000,10\n2023-11-05 02:00:00.0000000,1000,10\n")  # fmt: skip
    for zone in ("UTC", "America/New_York"):
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        assert read_workload(str(path)).arrival_s.tolist() == [0.0, 59.5], zone
    monkeypatch.undo()
    time.tzset()


def test_prefill_utilisation_counts_only_the_busy_time_inside_the_run() -> None:
    case = paper_case()
    config = replace(config_for(case, plan(case).homogeneous, drain=False), n_prefill=1, prefix_cache=False)
    prompts = np.array([2048, 2049, 2050, 2051, 2052])  # four at once on one node, then one while it is still busy
    forward = case.pd_prefill.latency_s(2048)
    arrival = np.array([0.0, 0.0, 0.0, 0.0, 2.5 * forward])
    result = Simulation(config, Workload("queued", arrival, prompts, np.full(5, 4))).run()  # stops at 2.5 forwards
    assert result.pd_prefill_utilisation == pytest.approx(1.0)
    point = plan(case).homogeneous
    overloaded = synthetic(case.lengths, 64, ArrivalSpec(ArrivalKind.UNIFORM, 1.3 * point.throughput_rps), 600.0, 3)
    result = Simulation(config_for(case, point, drain=False), overloaded).run()  # 30% more than the nodes can take
    assert 0.9 < result.pd_prefill_utilisation <= 1.0


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        ("2023-11-16 18:17:03,10000000000,10\n2023-11-16 18:17:04,100,10\n",
         "1 request(s) with more than 10,000,000 tokens of prompt and output"),
        ("2023-11-16 18:17:03,1000,1000000000\n2023-11-16 18:17:04,100,10\n", "the longest 1,000,001,000"),
        ("2023-11-16 18:17:03,100000000000000000000,10\n2023-11-16 18:17:04,100,10\n",
         "t.csv: a request with more than 10,000,000 tokens of prompt and output"),
        ("2023-11-16 18:17:03,1000,10\n9999-11-16 18:17:04,100,10\n", "days, more than the 31 days a run may simulate"),
    ],
)  # fmt: skip
def test_a_trace_past_the_bounds_is_one_error_line_not_a_run_without_end(tmp_path, rows: str, says: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    argv = [sys.executable, "-m", "minifaas.commands.main", "sim", "--trace", str(path), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and done.stdout == ""
    assert says in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_a_scaling_to_too_few_gpus_says_what_it_came_to_and_the_fewest_that_do() -> None:
    with pytest.raises(ValueError, match=r"scaled to 17 leave n_pd 1 and n_homogeneous 2 \(18 GPUs or more keep"):
        scaled_case(paper_case(), 17, None)
    assert (scaled_case(paper_case(), 18, None).n_pd, scaled_case(paper_case(), 18, None).n_homogeneous) == (2, 2)


def test_homogeneous_config_never_offloads() -> None:
    case = paper_case()
    config = config_for(case, plan(case).homogeneous)
    assert config.threshold == NO_OFFLOAD and config.n_prfaas == 0


def test_same_seed_same_run() -> None:
    case = paper_case()
    config = config_for(case, plan(case).prfaas)
    workload = synthetic(case.lengths, 1024, ArrivalSpec(ArrivalKind.BURSTY, 3.0), 300.0, seed=7)
    a, b = Simulation(config, workload).run(), Simulation(config, workload).run()
    assert a.to_dict() == b.to_dict()


def test_sim_json_command(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    csv_path = tmp_path / "queues.csv"
    argv = ["sim", "--case", "paper", "--duration", "120", "--load", "0.5", "--json", "--queues-csv", str(csv_path)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("requests", "throughput_rps", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_s"):
        assert key in out
    for key in (
        "offload_fraction",
        "prefix_hit_token_ratio",
        "egress_gbps_mean",
        "egress_gbps_p99",
        "link_utilisation",
    ):
        assert key in out
    assert out["requests"] > 100 and out["completed"] == out["requests"]
    assert csv_path.read_text().startswith("time_s,prfaas_prefill,pd_prefill")


@pytest.mark.parametrize("flags", [[], ["--scheduler"], ["--short-term", "default"], ["--long-term", "default"]])
def test_the_sim_summary_says_whether_a_scheduler_ran_and_the_split_it_ended_with(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--case", "paper", "--trace", "mooncake-synthetic", "--rate-scale", "2", "--json", *flags]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scheduler"] is bool(flags)
    start, end = (out["n_prefill"], out["n_decode"]), (out["n_prefill_final"], out["n_decode_final"])
    assert sum(end) == sum(start)
    re_roled = flags in (["--scheduler"], ["--long-term", "default"])  # the long-term scheduler moves the split here
    assert (end != start) == (out["role_conversions"] > 0) == re_roled, out


def test_sim_compare_json_prints_one_json_object_and_refuses_a_policy_twice(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "compare", "--duration", "60", "--policy", "default", "--policy", "kv-compression=auto", "--json"]
    argv += ["--plot", str(tmp_path / "c.png")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert list(json.loads(captured.out)) == ["default", "kv-compression=auto"]  # the whole of stdout
    assert "default" in captured.err and "kv-compression=auto" in captured.err  # the table, beside the notes
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--policy", "default"])
    assert stopped.value.code == 2
    assert "--policy default is given twice" in capsys.readouterr().err


def test_a_plan_that_leaves_pd_prefill_unused_says_why(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny CPU model's profile (slow prefill, slow decode) against the paper's H200 PrfaaS: every prompt goes
    to PrfaaS, so the PD prefill figures are null in JSON, and one line says why."""
    points = (ProfilePoint(64, 1.0, 176_128.0), ProfilePoint(256, 3.0, 299_008.0))
    save_profiles(tmp_path / "cpu.json", PrefillProfile("cpu", 1, points), DecodeProfile("cpu", 1, 8, 0.1))
    assert (
        main(["sim", "--case", "paper", "--pd-profile", str(tmp_path / "cpu.json"), "--duration", "300", "--json"]) == 0
    )
    captured = capsys.readouterr()
    out = json.loads(captured.out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert out["threshold_tokens"] == 0 and out["n_prefill"] == 0 and out["offload_fraction"] == 1.0
    assert out["ttft_pd_mean_s"] is None and out["ttft_prfaas_mean_s"] > 0
    assert "plan: PrfaaS prefills every prompt (t = 0)" in captured.err and "no request takes the PD" in captured.err


def test_sim_does_not_import_torch() -> None:
    code = "import sys, minifaas.commands.sim; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_spill_sends_short_prompts_to_prfaas_while_pd_prefill_is_behind(capsys: pytest.CaptureFixture[str]) -> None:
    """Over its planned load, PD-P falls behind: ``--spill-tokens`` offloads some short prompts too, as serve does."""
    offloaded = []
    for spill in ("0", "512"):
        assert (
            main(["sim", "--case", "paper", "--duration", "300", "--load", "1.2", "--spill-tokens", spill, "--json"])
            == 0
        )
        offloaded.append(json.loads(capsys.readouterr().out)["offload_fraction"])
    assert offloaded[1] > offloaded[0]


def test_on_shared_cores_the_workers_computing_share_them_from_moment_to_moment() -> None:
    case = paper_case()
    config = config_for(case, plan(case).homogeneous, early_first_token=True)
    alone = float(case.pd_prefill.latency_s(1024))
    both = Workload("pair", np.array([0.0, 0.0]), np.array([1024, 1024]), np.full(2, 4), ((1, 2), (3, 4)), 512)
    own = Simulation(config, both)
    own.run()
    assert own.first_token == pytest.approx([alone, alone], rel=1e-9)  # each worker on cores of its own
    shared = Simulation(replace(config, shared_cores=1), both)
    shared.run()
    assert shared.first_token == pytest.approx([2 * alone, 2 * alone], rel=1e-9)  # two on one core, half speed
    # the second starts halfway through the first: from then on both go at half speed, and the first is done
    # at 1.5 prefills, when the second has half of its own left, which it computes alone (one token each: no
    # decode step computes beside them)
    one = np.ones(2, dtype=int)
    later = Workload("later", np.array([0.0, alone / 2]), np.full(2, 1024), one, ((1, 2), (3, 4)), 512)
    staggered = Simulation(replace(config, shared_cores=1), later)
    staggered.run()
    assert staggered.first_token == pytest.approx([1.5 * alone, 2 * alone], rel=1e-9)
    # a measured contention: two computing take 1.3x each
    measured = Simulation(replace(config, shared_cores=2, contention=(1.0, 1.3)), later)
    measured.run()
    assert measured.first_token == pytest.approx([alone / 2 + 1.3 * alone / 2, alone + 1.3 * alone / 2], rel=1e-9)
    # three computing on two cores take turns: 1.3 x 3/2 each
    three = Workload("three", np.zeros(3), np.full(3, 1024), np.full(3, 4), ((1, 2), (3, 4), (5, 6)), 512)
    crowded = Simulation(replace(config, shared_cores=2, contention=(1.0, 1.3)), three)
    crowded.run()
    assert crowded.first_token == pytest.approx([1.95 * alone] * 3, rel=1e-9)


def test_a_prefill_beside_a_decoding_batch_alone_slows_by_its_own_measured_figure() -> None:
    case = paper_case()
    decode = replace(case.decode, bs_max=8, steps=((1, 0.01), (2, 0.015)))
    config = replace(config_for(case, plan(case).homogeneous, early_first_token=True), decode=decode, n_decode=1)
    alone = float(case.pd_prefill.latency_s(1024))
    # the first decodes 400 tokens, long enough to outlast the prefills that start while it does
    at = np.array([0.0, alone + 0.05])
    pair = Workload("pair", at, np.full(2, 1024), np.array([400, 2]), ((1, 2), (3, 4)), 512)
    table = replace(config, decode_step_by_batch=True, shared_cores=2, contention=(1.0, 1.3, 2.0))
    counted = Simulation(table, pair)
    counted.run()
    assert counted.first_token[0] == pytest.approx(alone, rel=1e-9)  # alone
    assert counted.first_token[1] - at[1] == pytest.approx(1.3 * alone, rel=1e-9)  # two computing, by the table
    kinds = Simulation(replace(table, beside_decode=1.5), pair)
    kinds.run()
    assert kinds.first_token[1] - at[1] == pytest.approx(1.5 * alone, rel=1e-9)  # beside the decoding batch alone
    # two prefills that start together while the batch decodes: three computing, each by the table
    at = np.array([0.0, alone + 0.05, alone + 0.05])
    three = Workload("three", at, np.full(3, 1024), np.array([400, 2, 2]), ((1, 2), (3, 4), (5, 6)), 512)
    crowded = Simulation(replace(table, beside_decode=1.5), three)
    crowded.run()
    assert np.array(crowded.first_token[1:]) - at[1] == pytest.approx([2.0 * alone] * 2, rel=1e-9)
    # the batch's steps slow too, more beside two prefills than beside one, than on cores of its own
    own = Simulation(replace(config, decode_step_by_batch=True), pair)
    own.run()
    assert crowded.finished[0] > kinds.finished[0] > own.finished[0]


def test_prompts_of_one_length_queued_behind_a_prefill_ride_in_one_forward() -> None:
    case = paper_case()
    config = replace(config_for(case, plan(case).homogeneous, early_first_token=True), n_prefill=1)
    three = Workload("three", np.zeros(3), np.full(3, 1024), np.full(3, 4), ((1, 2), (3, 4), (5, 6)), 512)
    one, two = (float(case.pd_prefill.latency_s(n)) for n in (1024, 2048))
    alone = Simulation(config, three)
    alone.run()
    assert alone.first_token == pytest.approx([one, 2 * one, 3 * one], rel=1e-9)  # one forward each, in turn
    batched = Simulation(replace(config, prefill_batch_tokens=2048), three)
    batched.run()
    # the first starts at once, alone; the two queued behind it share the next forward, and end together
    assert batched.first_token == pytest.approx([one, one + two, one + two], rel=1e-9)
    small = Simulation(replace(config, prefill_batch_tokens=1024), three)
    small.run()
    assert small.first_token == pytest.approx([one, 2 * one, 3 * one], rel=1e-9)  # the budget holds one


def test_a_decode_step_takes_the_profiles_time_at_the_rows_running_then() -> None:
    case = paper_case()
    decode = replace(case.decode, bs_max=8, steps=((1, 0.01), (2, 0.015)))
    config = replace(config_for(case, plan(case).homogeneous, early_first_token=True), decode=decode, n_decode=1)
    pair = Workload("pair", np.zeros(2), np.full(2, 1024), np.array([4, 8]), ((1, 2), (3, 4)), 512)
    joined = float(case.pd_prefill.latency_s(1024))  # both prefilled side by side, both join then
    fixed = Simulation(config, pair)
    fixed.run()
    assert fixed.finished == pytest.approx([joined + 3 * decode.step_time_s, joined + 7 * decode.step_time_s])
    by_batch = Simulation(replace(config, decode_step_by_batch=True), pair)
    by_batch.run()
    # three steps of two rows; then the second request's last four alone, at the one-row step
    assert by_batch.finished == pytest.approx([joined + 3 * 0.015, joined + 3 * 0.015 + 4 * 0.01], rel=1e-9)
    assert by_batch.first_token == fixed.first_token  # the prefill made the first token: the step has no part
    late = Simulation(replace(config, decode_step_by_batch=True, early_first_token=False), pair)
    late.run()
    # one step after each joins, at the rows running as it joins: the first joined alone, the second beside it
    assert late.first_token == pytest.approx([joined + 0.01, joined + 0.015], rel=1e-9)
    # on a shared host a step is slowed as a prefill is: here a long prefill beside the decoding request
    blocks = ((1, 2), tuple(range(3, 19)))
    beside = Workload("beside", np.array([0.0, 0.001]), np.array([1024, 8192]), np.array([11, 2]), blocks, 512)
    contended = replace(config, decode_step_by_batch=True, shared_cores=2, contention=(1.0, 2.0))
    run = Simulation(contended, beside)
    run.run()
    assert run.first_token[1] - 0.001 > run.finished[0]  # the long prefill outlasts the first request's decode
    assert run.finished[0] == pytest.approx(run.first_token[0] + 10 * 0.01 * 2.0, rel=1e-9)
    # with a hold, a step also waits its own length (at most the cap) while more are on their way than it holds
    blocks = ((1, 2), tuple(range(3, 19)), tuple(range(19, 35)))
    ahead = Workload(
        "ahead", np.array([0.0, 0.001, 0.002]), np.array([1024, 8192, 8192]), np.array([11, 2, 2]), blocks, 512
    )
    held = Simulation(replace(config, decode_step_by_batch=True, decode_hold=1.0, decode_hold_max_s=0.004), ahead)
    held.run()
    assert held.first_token[1] > held.finished[0]  # both long prompts still on their way as the first decodes
    assert held.finished[0] == pytest.approx(held.first_token[0] + 10 * (0.01 + 0.004), rel=1e-9)


def test_a_decode_step_adds_its_rows_padding_to_the_longest() -> None:
    case = paper_case()
    decode = replace(case.decode, bs_max=8, steps=((1, 0.01), (2, 0.015)), context=24, slot_s=1e-6)
    config = replace(config_for(case, plan(case).homogeneous, early_first_token=True), decode=decode, n_decode=1)
    pair = Workload("pair", np.zeros(2), np.full(2, 1024), np.array([4, 8]), ((1, 2), (3, 4)), 512)
    joined = float(case.pd_prefill.latency_s(1024))
    sim = Simulation(replace(config, decode_step_by_batch=True), pair)
    sim.run()
    # the rows hold 1024 + 3 // 2 and 1024 + 7 // 2 tokens halfway: the batch is 1028 slots wide, 1004 past context
    two, one = 0.015 + 1e-6 * 2 * 1004, 0.01 + 1e-6 * 1004
    assert sim.finished == pytest.approx([joined + 3 * two, joined + 3 * two + 4 * one], rel=1e-9)


def test_past_the_cores_workers_take_turns_each_as_slow_as_with_every_core_busy() -> None:
    case = paper_case()
    config = config_for(case, plan(case).homogeneous, shared_cores=2, contention=(1.0, 1.1, 1.2))
    # two fit two cores: the table's figure; three and four take turns: 1.1 times 3/2 and 4/2, over what the table
    # says (1.2, and past its end 1.2 * 4/3), a figure a calibration that caught a worker idle measures too low
    assert [config.slowdown(n) for n in (1, 2, 3, 4)] == pytest.approx([1.0, 1.1, 1.65, 2.2])
    # a decode worker that holds its steps computes half of each: a count between two, a figure between theirs
    assert config.slowdown(2.5) == pytest.approx((1.1 + 1.65) / 2) and config.slowdown(0.5) == 1.0
    assert replace(config, contention=(1.0, 1.1, 2.0)).slowdown(3) == 2.0
    assert replace(config, contention=()).slowdown(3) == 1.5
    assert replace(config, shared_cores=0).slowdown(4) == 1.0  # each worker on cores of its own
