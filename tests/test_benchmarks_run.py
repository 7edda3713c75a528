"""Every ``python benchmarks/...`` command quoted in README.md and docs/*.md runs, as a smoke run.

Each quoted command runs from the repository root as written plus ``--quick``
(every benchmark's smoke run: smaller sizes and fewer repeats on the same code
path) and ``--json``, less any ``--repeats N`` or ``--sizes N`` of the full run, and with this checkout as
any ``--against-tree PATH`` (``smoke_form``):
it must exit 0, print its table and end with one JSON line of finite figures.
Two run at a time, each a process forked from the pre-loaded interpreter
(``python`` in conftest.py). A benchmark whose own test runs it so and checks
its figures (``RUN_BY_OWN_TEST``: the chaos run, the simulator's fidelity run) is not run twice. The figures
in the docs come from full runs; these runs only prove that the commands a reader copies still work. Every benchmark
in benchmarks/ must be quoted somewhere, so none goes untested.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from preloaded import Preloaded
from test_docs_commands import DOCS, ROOT, code_of

pytestmark = pytest.mark.slow  # every benchmark's smoke run: minutes in all

_BENCHMARK = re.compile(r"(?:^|[\s(])python +(benchmarks/[\w/]+\.py)([^\n;|&#`]*)")


def benchmark_commands(markdown: str) -> list[list[str]]:
    """Each quoted ``python benchmarks/<name>.py [args]`` command as argv, the script first."""
    found = []
    for code in code_of(markdown):
        for match in _BENCHMARK.finditer(code):
            found.append([match.group(1), *shlex.split(match.group(2))])
    return found


def smoke_form(argv: list[str]) -> tuple[str, ...]:
    """A quoted command as its smoke run takes it: every run adds --json, and a full run's ``--repeats N`` and
    ``--sizes N`` give way to the smoke run's own (one repeat, small sizes), so quotes that differ only in those
    are one run. ``--against-tree PATH`` names a checkout on the machine that ran it: here, this one."""
    out: list[str] = []
    args = iter(argv)
    for a in args:
        if a in ("--repeats", "--sizes"):
            next(args, None)  # and its value
        elif a == "--against-tree":
            out += [a, str(ROOT)]
            next(args, None)
        elif a != "--json":
            out.append(a)
    return tuple(out)


UNIQUE = sorted({smoke_form(argv) for path in DOCS for argv in benchmark_commands(path.read_text())})


def _refuse(constant: str) -> float:
    raise ValueError(f"{constant} in the JSON line")


# the device check is not a --quick benchmark: tests/test_gpu_check.py runs it whole with --dry-run (every
# probe on the CPU), and its probes are the steps it runs
RUN_ELSEWHERE = {"benchmarks/gpu_check.py", "benchmarks/gpu_probe.py"}
# not benchmarks: the network-namespace test hosts that bench_wan, bench_transport and the two-host tests use
RUN_ELSEWHERE |= {"benchmarks/netns.py", "benchmarks/netns_delay.py"}
# not a benchmark: the synthetic states that the transport's tests and benchmarks share
RUN_ELSEWHERE |= {"benchmarks/synthetic.py"}
# run by their own tests as quoted, plus --quick --json, with checks of their figures: not run twice
RUN_BY_OWN_TEST = {
    "benchmarks/bench_chaos.py": "tests/test_chaos.py",
    "benchmarks/bench_sim_fidelity.py": "tests/test_sim_fidelity.py",
}
# a measurement tool, not a --quick benchmark: tests/test_reading_list.py runs it and holds docs/READING.md to it
RUN_ELSEWHERE |= {"benchmarks/request_path.py"}
SMOKE_RUNS = [argv for argv in UNIQUE if argv[0] not in RUN_BY_OWN_TEST and argv[0] not in RUN_ELSEWHERE]


def test_the_benchmarks_left_out_here_are_run_by_their_own_tests() -> None:
    for script, test in RUN_BY_OWN_TEST.items():
        assert f'"{script}", "--quick", "--json"' in (ROOT / test).read_text(), f"{test} does not run {script}"
    assert "request_path.measure(" in (ROOT / "tests" / "test_reading_list.py").read_text()


def test_every_benchmark_is_quoted() -> None:
    quoted = {argv[0] for argv in UNIQUE}
    present = {str(path.relative_to(ROOT)) for path in (ROOT / "benchmarks").glob("*.py")} - RUN_ELSEWHERE
    assert sorted(present - quoted) == [], "benchmarks no doc quotes (so no test runs them)"
    assert sorted(quoted - present - RUN_ELSEWHERE) == [], "the docs quote benchmarks that do not exist"


def test_extraction() -> None:
    text = (
        "| 7 | simulator | `python benchmarks/bench_sim.py` |\n\n"
        "    python benchmarks/bench_scheduler.py --load 0.8  # a comment\n\n"
        "(python benchmarks/bench_serve.py in prose is not a command) and python -m minifaas.commands.main\n"
    )
    assert benchmark_commands(text) == [
        ["benchmarks/bench_scheduler.py", "--load", "0.8"],
        ["benchmarks/bench_sim.py"],
    ]


def test_a_full_runs_repeats_sizes_and_json_flag_are_left_to_the_smoke_run() -> None:
    assert smoke_form(["b.py", "--repeats", "11", "--json", "--long", "256"]) == ("b.py", "--long", "256")
    assert smoke_form(["b.py", "--sizes", "128,256", "--soak", "0"]) == ("b.py", "--soak", "0")
    assert smoke_form(["b.py", "--threads", "1"]) == ("b.py", "--threads", "1")


def _run(python: Preloaded, argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return python.run([*argv, "--quick", "--json"], cwd=ROOT, env=dict(os.environ), timeout=600)


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, python: Preloaded
) -> Iterator[dict[tuple[str, ...], Future[subprocess.CompletedProcess[str]]]]:
    """The selected runs, two at a time: the live benchmarks spend much of their time waiting on
    process starts and emulated links, so a pair keeps both cores busy."""
    chosen = [
        item.callspec.params["argv"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_benchmark_runs_quick"
    ]
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        yield {argv: pool.submit(_run, python, argv) for argv in chosen}
    finally:  # after a failure under -x, the runs not started yet are dropped
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("argv", SMOKE_RUNS, ids=[" ".join(a) for a in SMOKE_RUNS])
def test_benchmark_runs_quick(
    argv: tuple[str, ...], runs: dict[tuple[str, ...], Future[subprocess.CompletedProcess[str]]]
) -> None:
    done = runs[argv].result()
    shown = f"`python {shlex.join([*done.args[1:]])}`"
    assert done.returncode == 0, f"{shown} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) >= 3, f"{shown} printed no table:\n{done.stdout}"
    figures = json.loads(lines[-1], parse_constant=_refuse)  # a NaN figure means a run that measured nothing
    assert isinstance(figures, dict) and figures, f"{shown}: the last line is not a JSON object of figures"
    assert not any(line.lstrip().startswith("{") for line in lines[:-1]), "the table comes before the one JSON line"


SCALE = next(argv for argv in SMOKE_RUNS if argv[0] == "benchmarks/bench_scale.py")


def test_bench_scale_holds_every_served_token_to_generate_and_counts_cpu_time(
    python: Preloaded, runs: dict[tuple[str, ...], Future[subprocess.CompletedProcess[str]]]
) -> None:
    """The quoted run has ``--check``, so a served token that differs from generate()'s row fails it."""
    assert "--check" in SCALE, "the docs quote bench_scale.py without --check"
    done = runs[SCALE].result() if SCALE in runs else _run(python, SCALE)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    summary = json.loads(done.stdout.splitlines()[-1])
    for row in summary["throughput"]:
        assert row["tokens_equal"] and row["unequal"] == 0 and row["refused"] == 0
        assert str(row["generate_best_threads"]) in row["generate_threads"]  # each thread count's figures
        names = ("generate_tok_s", "generate_tok_cpu_s", "served_tok_s", "served_tok_cpu_s", "ratio", "cpu_ratio")
        for name in (*names, "one_process_tok_s", "one_process_tok_cpu_s"):  # the one-process rows: generate_unequal
            assert row[name] > 0, name
        assert row["ratio"] == pytest.approx(row["served_tok_s"] / row["generate_tok_s"], rel=1e-3)
        loops = {part: cpu for part, cpu in row["served_cpu_by_thread"].items() if part.endswith(" loop")}
        assert any(part.startswith("pd-decode") for part in loops) and sum(loops.values()) > 0  # each part counted
        assert sum(row["served_cpu_by_thread"].values()) <= row["served_cpu_s"] * 1.05 + 0.05  # no tick twice
    assert summary["crowd"]["tok_cpu_s"] > 0
    checked = {(c["check"], c["n"]) for c in summary["checks"]}
    assert checked >= {("tokens equal", r["n"]) for r in summary["throughput"]}


def test_bench_scales_checks_fail_on_one_unequal_token_and_below_a_threshold() -> None:
    import bench_scale

    def row(n: int, ratio: float = 1.1, cpu_ratio: float = 0.9, unequal: int = 0) -> dict:
        return {"n": n, "ratio": ratio, "cpu_ratio": cpu_ratio, "unequal": unequal, "generate_unequal": 0,
                "tokens_equal": unequal == 0}  # fmt: skip

    def failed(rows: list[dict]) -> list[tuple[str, int]]:
        return [(c["check"], c["n"]) for c in bench_scale.checks(rows) if not c["ok"]]

    assert failed([row(1), row(32), row(128), row(256)]) == []
    assert failed([row(4, unequal=1)]) == [("tokens equal", 4)]
    assert failed([row(4, ratio=0.5, cpu_ratio=0.1)]) == []  # no bar below N = 32
    assert failed([row(32, ratio=0.99, cpu_ratio=0.1), row(128, cpu_ratio=0.79)]) == [
        ("ratio >= 1.0", 32),
        ("cpu_ratio >= 0.8", 128),
    ]


def test_bench_scales_split_by_thread_never_goes_negative_when_a_thread_ends_mid_run() -> None:
    """A thread that burned CPU before the run and ended during it takes its ticks with it, not off the rest."""
    import bench_scale

    burner = (
        "import sys, threading, time\n"
        "def burn_then_wait():\n"
        "    end = time.thread_time() + 0.5\n"
        "    while time.thread_time() < end: pass\n"
        "    print('burned', flush=True); sys.stdin.readline()\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a thread that stays\n"
        "worker = threading.Thread(target=burn_then_wait); worker.start(); worker.join(); time.sleep(30)\n"
    )  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", burner], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "burned\n"
        server = bench_scale.Server(proc, "")
        before = server.thread_cpu_s()
        proc.stdin.write("go\n")
        proc.stdin.flush()  # the waiting thread ends
        deadline = time.monotonic() + 10
        while len(list(Path(f"/proc/{proc.pid}/task").iterdir())) > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        split = bench_scale.cpu_by_part(before, server.thread_cpu_s())
        assert split and all(cpu >= 0 for cpu in split.values()), split
    finally:
        proc.kill()
        proc.wait()


def test_a_second_tree_is_what_its_server_imports_even_from_this_checkouts_root(tmp_path: Path) -> None:
    """``--against-tree``'s server runs ``python -m`` from this checkout's root, which Python would put first on the
    path: the environment keeps it off, so the other tree's minifaas is the one imported."""
    import bench_scale

    shutil.copytree(ROOT / "minifaas", tmp_path / "minifaas", ignore=shutil.ignore_patterns("__pycache__"))
    env = bench_scale.tree_env(tmp_path)
    where = "import minifaas.commands.main, minifaas; print(minifaas.__file__)"
    done = subprocess.run([sys.executable, "-c", where], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert Path(done.stdout.strip()) == tmp_path / "minifaas" / "__init__.py"
    unsafe = {**env, "PYTHONSAFEPATH": ""}  # as before the fix: this checkout's minifaas
    done = subprocess.run([sys.executable, "-c", where], cwd=ROOT, env=unsafe, capture_output=True, text=True)
    assert Path(done.stdout.strip()) == ROOT / "minifaas" / "__init__.py"
    with pytest.raises(RuntimeError, match="not from the tree"):
        bench_scale.tree_env(tmp_path / "empty")


def test_a_servers_cpu_time_keeps_what_its_ended_children_spent() -> None:
    """A child that spins and ends before the second reading still counts: its parent reaped it (cutime)."""
    import bench_scale

    parent = (
        "import subprocess, sys; "
        "subprocess.run([sys.executable, '-c', 'import time\\nend = time.process_time() + 0.5\\n"
        "while time.process_time() < end: pass']); "
        "print('ended', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        server = bench_scale.Server(proc, "")
        before = server.cpu_s()
        assert proc.stdout is not None and proc.stdout.readline() == "ended\n"
        assert server.cpu_s() - before >= 0.4
    finally:
        proc.kill()
        proc.wait()


def test_a_benchmark_stopped_with_sigterm_stops_its_server() -> None:
    """``serving`` turns this process's SIGTERM into an exit that stops the server in its own session."""
    script = (
        "import sys, time; sys.path.insert(0, 'benchmarks'); import bench_scale\n"
        "with bench_scale.serving(['--model', 'kimi-linear-tiny']) as server:\n"
        "    print(server.proc.pid, flush=True); time.sleep(600)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout is not None
        server = int(bench.stdout.readline())
        os.kill(server, 0)  # serving
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=90) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):  # stopped and reaped: gone
            os.kill(server, 0)
    finally:
        bench.kill()
        bench.wait()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench_scale.py", "--sizes", "0"], "argument --sizes: need integers >= 1"),
        (["bench_scale.py", "--repeats", "0"], "argument --repeats: need an integer >= 1"),
        (["bench_serve.py", "--repeats", "0"], "argument --repeats: need an integer >= 1"),
        (["bench_decode_batch.py", "--streams", "0"], "argument --streams: need integers >= 1"),
        (["bench_sim_fidelity.py", "--requests", "0"], "argument --requests: need an integer >= 1"),
        (["bench_sim.py", "--gpus", "3"], "--gpus 3: paper: need"),
    ],
)
def test_a_benchmark_refuses_a_bad_count_in_one_error_line(argv: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, f"benchmarks/{argv[0]}", *argv[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
