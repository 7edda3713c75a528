"""The planner: profiles, length distributions, the throughput model and its search."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from minifaas.commands.main import main
from minifaas.planner import LengthDistribution, SearchGrid, best_prfaas, load_case, load_profiles, plan, stages
from minifaas.planner.model import operating_point
from minifaas.planner.paper import H20_PREFILL, H200, H200_TABLE, REPORTED, paper_case
from minifaas.traces import trace_path


def test_h200_fit_matches_the_published_fit() -> None:
    c0, c1, c2 = H200.latency_coeffs
    assert c0 == pytest.approx(0.389, abs=1e-3)
    assert c1 == pytest.approx(4.107e-5, rel=1e-3)
    assert c2 == pytest.approx(9.48e-11, rel=1e-3)


def test_kv_throughput_reproduces_the_profile_table() -> None:
    published_gbps = {1024: 3.61, 8192: 3.59, 32768: 3.19, 131072: 2.62}
    for point in H200_TABLE:
        measured = point.kv_bytes * 8 / point.latency_s / 1e9
        assert measured == pytest.approx(published_gbps[point.tokens], rel=0.02)
        phi_kv = H200.kv_bytes(point.tokens) * 8 / H200.latency_s(point.tokens) / 1e9  # eq 1, in Gbit/s
        assert float(phi_kv) == pytest.approx(measured, rel=0.05)
    assert H200.kv_bytes_per_token / 1024 == pytest.approx(16.7, rel=0.01)  # KiB per token
    assert H200.kv_fixed_bytes / 2**20 == pytest.approx(172, rel=0.02)  # MiB


def test_truncated_lognormal_mean_and_bounds() -> None:
    lengths = paper_case().lengths
    assert lengths.mean == pytest.approx(27_300, rel=0.01)
    assert lengths.values[0] >= 128 and lengths.values[-1] <= 128_000


def test_split_matches_a_direct_count() -> None:
    rng = np.random.default_rng(3)
    raw = rng.integers(1, 10_000, size=500)
    dist = LengthDistribution.empirical("raw", raw)
    for t in (0, 50, 4_999, 9_999, 20_000):
        p, l_long, l_short = dist.split(t)
        long, short = raw[raw > t], raw[raw <= t]
        assert float(p) == pytest.approx(long.size / raw.size)
        assert (math.isnan(float(l_long)) and long.size == 0) or float(l_long) == pytest.approx(long.mean())
        assert (math.isnan(float(l_short)) and short.size == 0) or float(l_short) == pytest.approx(short.mean())


def test_paper_case_finds_the_papers_operating_point() -> None:
    """A fit, not a prediction, for the two gains: the H20 prefill curve (paper.py) is not published, and
    its coefficients were chosen so the planner lands on the paper's results; the gains move with it
    (the next test). The egress is held out of it, checked there."""
    result = plan(paper_case())
    best = result.prfaas
    assert (best.n_prefill, best.n_decode) == (3, 5)
    assert 18_000 <= best.threshold_tokens <= 21_000
    assert 0.45 <= best.offload_fraction <= 0.55
    assert result.gain_vs_homogeneous == pytest.approx(REPORTED["gain_vs_homogeneous"], abs=0.04)
    assert result.gain_vs_naive == pytest.approx(REPORTED["gain_vs_naive"], abs=0.04)
    assert best.egress_gbps == pytest.approx(REPORTED["prfaas_egress_gbps"], rel=0.1)
    assert best.bottleneck == "prfaas-compute"  # compute-bound, with link headroom
    assert (result.homogeneous.n_prefill, result.homogeneous.n_decode) == (9, 3)


@pytest.mark.parametrize("scale", [0.8, 1.2])
def test_the_papers_egress_is_held_out_of_the_h20_fit_and_the_gains_are_not(scale: float) -> None:
    """Held out: the PrfaaS egress the paper reports (about 13 Gbps). It is the H200s' KV rate at the
    offloaded requests' mean length (eq 2, from the measured H200 table), which the H20 curve hardly moves:
    with its linear term 20% either way the egress stays within 10% of the paper's figure, while both gains
    leave the band the reproduction above allows; the naive baseline uses no H20 prefill at all."""
    c0, c1, c2 = H20_PREFILL.latency_coeffs
    moved = replace(paper_case(), pd_prefill=replace(H20_PREFILL, latency_coeffs=(c0, c1 * scale, c2)))
    result, fitted = plan(moved), plan(paper_case())
    assert result.prfaas.egress_gbps == pytest.approx(REPORTED["prfaas_egress_gbps"], rel=0.1)
    assert abs(result.gain_vs_homogeneous - REPORTED["gain_vs_homogeneous"]) > 0.04
    assert abs(result.gain_vs_naive - REPORTED["gain_vs_naive"]) > 0.04
    assert result.naive.throughput_rps == fitted.naive.throughput_rps
    assert result.naive.egress_gbps == fitted.naive.egress_gbps


def test_optimum_balances_the_two_prefill_bounds() -> None:  # eq 7
    case = paper_case()
    best = best_prfaas(case)
    s = stages(case, np.array([best.threshold_tokens]), case.n_prfaas, best.n_prefill, best.n_decode)
    assert float(s["bound_prfaas"][0]) == pytest.approx(float(s["bound_pdp"][0]), rel=0.02)


def test_grid_search_equals_brute_force_over_scalar_points() -> None:
    case = paper_case().with_overrides(n_pd=6, link_gbps=20.0)
    grid = SearchGrid(threshold_step=2_000)
    best = best_prfaas(case, grid)
    brute = max(
        operating_point("x", case, float(t), case.n_prfaas, n_p, case.n_pd - n_p).throughput_rps
        for n_p in range(case.n_pd)
        for t in grid.thresholds(case)
    )
    assert best.throughput_rps == pytest.approx(brute, rel=1e-9)


def test_scarce_link_binds_the_transfer_and_caps_egress() -> None:
    case = paper_case().with_overrides(link_gbps=5.0)
    best = best_prfaas(case)
    assert best.egress_gbps is not None and best.egress_gbps <= 5.0 + 1e-9
    assert best.throughput_rps < plan(paper_case()).prfaas.throughput_rps
    tight = operating_point("x", case, 0.0, case.n_prfaas, 0, case.n_pd)
    assert tight.bottleneck == "prfaas-link"


def test_profiles_and_cases_load_from_toml_and_json(tmp_path) -> None:
    toml = tmp_path / "h20.toml"
    toml.write_text(
        '[prefill]\nname = "A"\ngpus_per_instance = 8\npoints = [[1000, 0.5, 1e8], [9000, 1.5, 3e8]]\n'
        '[decode]\nname = "A"\ngpus_per_instance = 8\nbs_max = 16\nstep_time_s = 0.02\n'
    )
    prefill, decode = load_profiles(toml)
    assert prefill is not None and decode is not None
    assert float(prefill.latency_s(5000)) == pytest.approx(1.0)
    assert float(prefill.kv_bytes(13000)) == pytest.approx(4e8)  # linear extrapolation
    assert decode.requests_per_s(100) == pytest.approx(16 / 2.0)
    case_file = tmp_path / "case.json"
    profile = {"name": "B", "gpus_per_instance": 8, "latency_coeffs": [0.4, 1e-4], "kv_bytes_per_token": 1e4}
    case_file.write_text(
        json.dumps(
            {
                "name": "json-case",
                "n_prfaas": 2,
                "n_pd": 4,
                "n_homogeneous": 6,
                "link_gbps": 50,
                "output_tokens": 512,
                "lengths": {"mu": 8.0, "sigma": 1.0, "low": 100, "high": 50_000},
                "prfaas": profile,
                "pd_prefill": profile | {"latency_coeffs": [0.4, 3e-4]},
                "decode": {"name": "D", "gpus_per_instance": 8, "bs_max": 32, "step_time_s": 0.03},
            }
        )
    )
    case = load_case(case_file)
    assert case.name == "json-case" and case.n_pd == 4
    assert plan(case).prfaas.throughput_rps > 0


def test_a_slowed_profile_takes_longer_by_its_factor_and_keeps_its_state_sizes() -> None:
    fitted = paper_case().prfaas
    for profile in (fitted, replace(fitted, latency_coeffs=())):  # a polynomial, then its table of points
        slower = profile.slowed(1.5)
        tokens = np.array([1, 512, 8192, 65536])
        assert slower.latency_s(tokens) == pytest.approx(1.5 * profile.latency_s(tokens), rel=1e-12)
        assert np.array_equal(slower.kv_bytes(tokens), profile.kv_bytes(tokens))


def test_a_kv_growth_of_zero_is_a_model_whose_state_does_not_grow() -> None:
    case = paper_case().with_kv(0.0, None)  # minifaas plan --kv-bytes-per-token 0: linear layers alone
    tokens = np.array([1, 8192, 65536])
    assert np.all(case.prfaas.kv_bytes(tokens) == case.prfaas.kv_fixed_bytes)
    assert plan(case).prfaas.egress_gbps < plan(paper_case()).prfaas.egress_gbps / 4  # only the fixed state crosses
    table = replace(paper_case().prfaas, kv_bytes_per_token=None)  # no growth given: the points' bytes
    assert table.kv_bytes(8192) == pytest.approx(np.interp(8192, *zip(*[(q.tokens, q.kv_bytes) for q in table.points])))


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        paper_case().with_overrides(link_gbps=-1.0)
    with pytest.raises(ValueError):
        LengthDistribution.lognormal(9.9, 1.0, 500, 100)
    with pytest.raises(ValueError):
        type(H20_PREFILL)(name="x", gpus_per_instance=8, latency_coeffs=(-1.0,), kv_bytes_per_token=1.0)


CASE_TOML = """name = "mine"
n_prfaas = 4
n_pd = 8
n_homogeneous = 12
link_gbps = 100.0
output_tokens = 1024
[lengths]
mu = 9.90
sigma = 1.00
low = 128
high = 128000
[prfaas]
name = "H200x8"
gpus_per_instance = 8
latency_coeffs = [0.389, 4.107e-5, 9.48e-11]
kv_bytes_per_token = 17137
[pd_prefill]
name = "H20x8"
gpus_per_instance = 8
latency_coeffs = [0.4, 1.399e-4, 3.15e-11]
kv_bytes_per_token = 17137
[decode]
name = "H20x8"
gpus_per_instance = 8
bs_max = 20
step_time_s = 0.025
"""


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        ("mu = 9.90", "mu = nan", "[lengths] mu must be a finite number, got nan"),
        ("sigma = 1.00", "sigma = nan", "[lengths] sigma must be a finite number, got nan"),
        ("high = 128000", "high = inf", "[lengths] high must be a finite number, got inf"),
        ("link_gbps = 100.0", "link_gbps = nan", "link_gbps must be a finite number, got nan"),
        ("link_gbps = 100.0", "link_gbps = 'nan'", "link_gbps must be a finite number, got 'nan'"),
        ("output_tokens = 1024", "output_tokens = inf", "output_tokens must be a finite number, got inf"),
        ("step_time_s = 0.025", "step_time_s = nan", "[decode] step_time_s must be a finite number, got nan"),
        ("kv_bytes_per_token = 17137\n[pd", "kv_bytes_per_token = nan\n[pd", "[prfaas] kv_bytes_per_token must be a"),
        ("[0.389,", "[nan,", "[prfaas] latency_coeffs must be finite numbers, got [nan, 4.107e-05, 9.48e-11]"),
        ("bs_max = 20", "bs_max = 20\nbogus = 1", "[decode] unknown settings ['bogus'] (known: name, gpus"),
        ("low = 128", "low = 128\nlow_tokens = 5", "[lengths] unknown settings ['low_tokens'] (known: mu, sigma, low"),
        ("mu = 9.90", "trace = 'azure-code'\nmu = 9.90", "[lengths] unknown settings ['high', 'low', 'mu', 'sigma']"),
        ("[lengths]\nmu = 9.90\nsigma = 1.00\nlow = 128\nhigh = 128000\n", "lengths = 3\n", "[lengths] must be a"),
        ("kv_bytes_per_token = 17137\n[pd", "kv_bytes_per_token = 17137\npoints = [[1024, 0.44], [2048, 0.5]]\n[pd",
         "H200x8: points must be a list of [tokens, seconds, kv_bytes], got [[1024, 0.44], [2048, 0.5]]"),
        ("step_time_s = 0.025", "step_time_s = 0.025\nsteps = [[1, 0.01, 3]]",
         "H20x8: steps must be a list of [batch, seconds], got [[1, 0.01, 3]]"),
        ("step_time_s = 0.025", "step_time_s = 0.025\nsteps = 'abc'", "H20x8: steps must be a list of [batch, sec"),
    ],
)  # fmt: skip
def test_a_case_file_with_a_number_not_finite_or_an_unknown_setting_is_one_error_line(
    old: str, new: str, says: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ok.toml").write_text(CASE_TOML)
    assert main(["plan", "--case", str(tmp_path / "ok.toml"), "--json"]) == 0
    capsys.readouterr()
    assert old in CASE_TOML
    (tmp_path / "case.toml").write_text(CASE_TOML.replace(old, new, 1))
    with pytest.raises(SystemExit) as done:
        main(["plan", "--case", str(tmp_path / "case.toml")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1, err
    assert f"case.toml: {says}" in err, err


def test_the_plan_table_keeps_every_figure_apart_however_wide(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--output-tokens", "1"]) == 0  # one output token: a decode capacity of thousands
    lines = capsys.readouterr().out.splitlines()
    header = lines[1].split()
    rows = {line.split()[0]: dict(zip(header, line.split(), strict=True)) for line in lines[2:5]}
    assert set(rows) == {"prfaas", "homogeneous", "naive"}
    assert all(float(row["Th_pdd"]) > 0 for row in rows.values()) and float(rows["naive"]["Th_pdd"]) > 1000, rows


def test_a_plan_with_no_prfaas_instance_says_naive_serves_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--n-prfaas", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("vs naive: - (it serves nothing)")


def test_plan_json_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--case", "paper", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"prfaas", "homogeneous", "naive"}
    fields = {"threshold_tokens", "n_prfaas", "n_prefill", "n_decode", "offload_fraction", "throughput_rps"}
    for config in out.values():
        assert fields | {"egress_gbps"} <= set(config)
    assert out["homogeneous"]["egress_gbps"] is None and out["naive"]["threshold_tokens"] is None
    assert out["prfaas"]["throughput_rps"] > out["naive"]["throughput_rps"] > out["homogeneous"]["throughput_rps"]


def test_plan_does_not_import_torch() -> None:
    code = "import sys, minifaas.commands.plan; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_dense_kv_hits_the_link_and_price_ratio_adds_cost(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--case", "paper", "--json", "--kv-bytes-per-token", "253952", "--kv-fixed-bytes", "0"]
    assert main([*argv, "--link-gbps", "50", "--price-ratio", "2"]) == 0
    dense = json.loads(capsys.readouterr().out)
    assert dense["prfaas"]["egress_gbps"] == pytest.approx(50.0, rel=0.01)  # the link is the wall
    assert dense["prfaas"]["threshold_tokens"] > 30_000  # fewer, longer offloads
    assert dense["prfaas"]["cost_units"] == 4 * 8 * 2 + 8 * 8
    assert dense["homogeneous"]["cost_units"] == 12 * 8
    assert main(["plan", "--case", "paper", "--json"]) == 0
    hybrid = json.loads(capsys.readouterr().out)
    assert "cost_units" not in hybrid["prfaas"]
    assert dense["prfaas"]["throughput_rps"] < hybrid["prfaas"]["throughput_rps"]


def test_expected_latency_never_promises_more_and_equals_the_paper_for_linear_costs() -> None:
    case = paper_case()
    paper_form, expected = plan(case), plan(case, expected_latency=True)
    for config in ("prfaas", "homogeneous", "naive"):
        assert getattr(expected, config).throughput_rps <= getattr(paper_form, config).throughput_rps + 1e-12
    assert expected.naive.throughput_rps < 0.98 * paper_form.naive.throughput_rps  # the whole spread on H200s
    linear = case.with_overrides(
        prfaas=replace(case.prfaas, latency_coeffs=(0.4, 4e-5)),
        pd_prefill=replace(case.pd_prefill, latency_coeffs=(0.4, 1.4e-4)),
    )
    a, b = plan(linear, expected_latency=True), plan(linear)
    for config in ("prfaas", "homogeneous", "naive"):
        x, y = getattr(a, config), getattr(b, config)
        assert (x.threshold_tokens, x.n_prefill) == (y.threshold_tokens, y.n_prefill)
        assert x.throughput_rps == pytest.approx(y.throughput_rps, rel=1e-9)


def test_profiles_round_trip_through_a_file(tmp_path) -> None:
    from minifaas.planner.paper import H20_DECODE
    from minifaas.planner.profile import save_profiles

    path = tmp_path / "h200.json"
    save_profiles(path, H200, H20_DECODE)
    assert load_profiles(path) == (H200, H20_DECODE)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda d: d["prefill"].update(kv_bytes_per_token=math.nan), "[prefill] kv_bytes_per_token must be a finite"),
        (lambda d: d["prefill"].update(latency_coeffs=[0.4, math.inf]), "[prefill] latency_coeffs must be finite"),
        (lambda d: d["decode"].update(step_time_s="nan"), "[decode] step_time_s must be a finite number, got 'nan'"),
        (lambda d: d["decode"].update(bogus=1), "[decode] unknown settings ['bogus'] (known: name, gpus_per_instance"),
        (lambda d: d.update(meta={}), "unknown tables ['meta'] (known: prefill, decode)"),
        (lambda d: d["decode"].update(steps=[[1, 0.01, 3]]), "[decode]: H20x8: steps must be a list of [batch, sec"),
        (lambda d: d["prefill"].update(points=[[1024, 0.4]]), "[prefill]: H200x8: points must be a list of [tokens,"),
    ],
)
def test_a_profile_file_with_a_number_not_finite_or_an_unknown_setting_is_one_error_line(
    change, says: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from minifaas.planner.paper import H20_DECODE
    from minifaas.planner.profile import profile_tables

    data = profile_tables(H200, H20_DECODE)
    change(data)
    (tmp_path / "pd.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit) as done:
        main(["sim", "--pd-profile", str(tmp_path / "pd.json"), "--duration", "10"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1, err
    assert f"pd.json: {says}" in err, err


@pytest.mark.parametrize("trace", ["azure-code", str(trace_path("azure-code"))], ids=["name", "path"])
def test_a_case_file_can_take_its_lengths_from_a_trace(tmp_path, trace: str) -> None:
    text = (tmp_path / "case.toml").write_text(
        f'name = "azure-code"\nn_prfaas = 4\nn_pd = 8\nn_homogeneous = 12\nlink_gbps = 100\noutput_tokens = 28\n'
        f'[lengths]\ntrace = "{trace}"\n'
        '[prfaas]\nname = "A"\ngpus_per_instance = 8\nlatency_coeffs = [0.389, 4.107e-5, 9.48e-11]\n'
        "kv_fixed_bytes = 1.8e8\nkv_bytes_per_token = 17137\n"
        '[pd_prefill]\nname = "B"\ngpus_per_instance = 8\nlatency_coeffs = [0.4, 1.399e-4, 3.15e-11]\n'
        "kv_fixed_bytes = 1.8e8\nkv_bytes_per_token = 17137\n"
        '[decode]\nname = "C"\ngpus_per_instance = 8\nbs_max = 20\nstep_time_s = 0.025\n'
    )
    assert text > 0
    case = load_case(tmp_path / "case.toml")
    assert case.lengths.values.size == 8_819
    assert case.lengths.mean == pytest.approx(2_048, rel=0.01)
    assert plan(case).prfaas.throughput_rps > 0


def test_decode_profile_from_measured_steps_meets_the_slo() -> None:
    from minifaas.planner.paper import H20_DECODE
    from minifaas.planner.profile import DecodeProfile, decode_from_dict, profile_tables

    steps = [(1, 0.008), (8, 0.012), (16, 0.019), (20, 0.024), (24, 0.029), (32, 0.04)]
    profile = DecodeProfile.from_steps("H20x8", 8, steps, slo_tokens_per_s=40)
    assert (profile.bs_max, profile.step_time_s) == (20, 0.024)  # the step measured at BS_max, not 1/SLO
    assert profile.requests_per_s(1024) == pytest.approx(20 / (0.024 * 1024))
    assert H20_DECODE.requests_per_s(1024) == pytest.approx(0.78, rel=0.01)  # PRFAAS.md's figure, paced at the SLO
    # every measured step is kept: a batch's step interpolated, the smallest's below, the last slope above
    assert profile.steps == tuple(steps)
    assert profile.step_s(1) == profile.step_s(0) == 0.008
    assert profile.step_s(12) == pytest.approx(0.0155)
    assert profile.step_s(40) == pytest.approx(0.04 + 8 * 0.011 / 8)
    assert H20_DECODE.step_s(1) == H20_DECODE.step_s(100) == H20_DECODE.step_time_s  # none kept: one step time
    # rows padded to the longest: each row of a batch 1,064 slots wide pays 1,000 slots past the measured context
    wide = replace(profile, context=64, slot_s=1e-7)
    assert wide.step_s(12, 1064) == pytest.approx(0.0155 + 12 * 1000 * 1e-7)
    assert wide.step_s(12, 32) == wide.step_s(12) == pytest.approx(0.0155)
    assert decode_from_dict(profile_tables(decode=wide)["decode"]) == wide
    with pytest.raises(ValueError, match="slot_s"):
        replace(profile, slot_s=-1.0)
    with pytest.raises(ValueError, match="increasing batch"):
        DecodeProfile("bad", 1, 4, 0.01, steps=((4, 0.01), (1, 0.005)))
    with pytest.raises(ValueError):
        DecodeProfile.from_steps("slow", 8, [(1, 0.05)], slo_tokens_per_s=40)


@pytest.mark.parametrize(
    ("name", "starts"),
    [("plan.png", b"\x89PNG\r\n\x1a\n"), ("plan.pdf", b"%PDF"), ("plan.svg", b"<?xml"), ("plan.JPG", b"\xff\xd8\xff")],
)
def test_plan_plot_draws_each_format_it_takes(tmp_path, name: str, starts: bytes) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / name
    assert main(["plan", "--case", "paper", "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(starts)
