"""The ``minifaas`` command itself: its help, every flag's help and default, and one error line for bad input."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from minifaas.commands.main import COMMANDS, HelpFormatter, command_parser, main
from minifaas.planner.paper import H20_DECODE, H200
from minifaas.planner.profile import save_profiles


def test_top_level_help_describes_minifaas_and_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "Prefill-as-a-Service" in out and "``" not in out and "subcommand module" not in out
    assert all(name in out for name in COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_has_help_that_shows_its_default(name: str) -> None:
    parser = command_parser(name)
    formatter = HelpFormatter(parser.prog)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0] if action.option_strings else action.dest  # a positional: its name
        assert action.help, f"minifaas {name} {flag} has no help"
        takes_value = action.nargs != 0
        if takes_value and not action.required:
            shown = formatter._get_help_string(action) or ""
            assert "default" in shown, f"minifaas {name} {flag}: the help does not say its default"
    parser.format_help()  # every help string formats (a stray % would raise here)


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


WORKER = ["worker", "--role", "prefill", "--cluster", "pd", "--secret-file", "secret"]  # a secret the test writes
BAD_INPUT = [
    (["kv-size", "--model", "nope"], "no model 'nope': not a preset (kimi-linear-tiny"),
    (["kv-size", "--lengths", "1k"], "not a list of integers"),
    (["kv-size", "--baseline", "nope"], "no model 'nope'"),
    (["kv-size", "--model", "garbled.json"], "garbled.json: not JSON (Expecting value"),
    (["kv-size", "--model", "tableless.json"], "tableless.json: no setting 'num_hidden_layers' in the config"),
    (["serve", "--model", "nope"], "no model 'nope'"),
    (["serve", "--config", "missing.toml"], "missing.toml: No such file or directory"),
    (["serve", "--profile", "missing.json"], "missing.json: No such file or directory"),
    (["serve", "--threshold", "-1"], "need threshold >= 0"),
    (["serve", "--profile", "prefill-only.json"], "prefill-only.json: a profile needs [prefill] and [decode] tables"),
    (["serve", "--router", "default", "--router-arg", "foo=1"], "router 'default': its constructor refuses ['foo']: "),
    (["serve", "--router-arg", "config=1"], "router 'default': TypeError: config must be a RouterConfig, got 1"),
    (["sim", "--router-arg", "config=1"], "router 'default': TypeError: config must be a RouterConfig, got 1"),
    (["serve", "--short-term-arg", "history=1"], "short_term 'default': its constructor refuses ['history']"),
    (["sim", "--scheduler", "--short-term-arg", "config=1"], "TypeError: config must be a ShortTermConfig, got 1"),
    (["sim", "--scheduler", "--short-term-arg", "rule=x"], "short_term 'default': ValueError: 'x' is not a valid Rule"),
    (["sim", "--scheduler", "--short-term-arg", "threshold=true"], "threshold must be an integer, got True"),
    (["sim", "--long-term", "default", "--long-term-arg", "case=1"], "TypeError: case must be a PlanCase, got 1"),
    (["sim", "--long-term", "default", "--long-term-arg", "n_decode=2.5"], "n_decode must be an integer, got 2.5"),
    (["sim", "--long-term", "default", "--long-term-arg", "_lengths=[]"], "its constructor refuses ['_lengths']"),
    (["serve", "--api-key", ""], "--api-key is empty: give a key, or leave the flag out for an open server"),
    (["serve", "--config", "own-prfaas.toml"], "tableless.json: no [prefill] table"),
    (["serve", "--link-rate", "fast"], "not a rate: 'fast'"),
    (["serve", "--link-rate", "0mbit"], "a rate must be positive, got '0mbit'"),
    (["serve", "--link-rate", "0"], "a rate must be positive, got '0' (none: unlimited)"),
    (["serve", "--prefill-chunk", "-5"], "prefill_chunk must be >= 0"),
    (["serve", "--link-delay-ms", "nan"], "delay_ms must be a finite number, got nan"),
    (["serve", "--pd-device", "gpu0"], "not a device: 'gpu0'"),
    (["demo", "--model", "nope"], "no model 'nope'"),
    (["demo", "--link-rate", "fast"], "not a rate"),
    (["demo", "--duration", "60"], "--duration goes with --dashboard"),
    (["serve", "--pd-worker", "127.0.0.1:9", "--pd-decode-workers", "1"], "--pd-decode-workers does not apply with"),
    (["serve", "--prfaas-worker", "127.0.0.1:9", "--prfaas-workers", "2"], "--prfaas-workers does not apply with --"),
    (["demo", "--long-tokens", "40000"], "the longest prompt (40297 tokens) and --max-tokens 24: more than shakesp"),
    (["demo", "--dashboard", "--max-tokens", "32000"], "and --max-tokens 32000: more than shakespeare-qwen3.5's"),
    (["demo", "--short", "-1"], "need --short, --long >= 0"),
    (["demo", "--short", "0", "--long", "0"], "need --short, --long >= 0 (not both 0)"),
    (["generate", "--model", "nope"], "no model 'nope'"),
    (["generate", "--model", "tableless.json"], "tableless.json: a bare config.json has no weights; use a preset"),
    (["profile", "--model", "weightless"], "weightless/config.json: a bare config.json has no weights"),
    (["serve", "--model", "weightless"], "weightless/config.json: a bare config.json has no weights"),
    (["generate", "--temperature", "-1"], "temperature must be in [0, 100]"),
    (["generate", "--max-tokens", "x"], "invalid int value: 'x'"),
    (["generate", "--device", "cuda:99"], "no device cuda:99: this machine has"),
    (["generate", "--prompt", ""], "--prompt: '' is no tokens to"),
    (["generate", "--max-tokens", "40000"], "--max-tokens 40000: more than shakespeare-qwen3.5's context of 32768"),
    (["plan", "--case", "missing.toml"], "missing.toml: No such file or directory"),
    (["plan", "--case", "tableless.json"], "tableless.json: no 'lengths'"),
    (["plan", "--case", "garbled.json"], "garbled.json: not a case (Expecting value"),
    (["plan", "--case", "own-prfaas.toml"], "own-prfaas.toml: unknown settings ['scheduler'] (known: name,"),
    (["plan", "--link-gbps", "0"], "argument --link-gbps: need a number > 0, got '0'"),
    (["plan", "--price-ratio", "nan"], "argument --price-ratio: need a number > 0, got 'nan'"),
    (["plan", "--output-tokens", "nan"], "argument --output-tokens: need a number > 0, got 'nan'"),
    (["demo", "--duration", "nan"], "argument --duration: need a number > 0, got 'nan'"),
    (["link-emulator", "--target", "127.0.0.1:9", "--delay-ms", "nan"], "argument --delay-ms: need a number >= 0"),
    (["worker", "--gpu-memory-fraction", "2"], "argument --gpu-memory-fraction: need a number in [0, 1], got '2'"),
    (["worker", "--role", "decode", "--cluster", "prfaas"], "the PrfaaS cluster only prefills: --role decode needs"),
    (["serve", "--pd-worker", "127.0.0.1:99999"], "argument --pd-worker: '127.0.0.1:99999' is not HOST:PORT"),
    (["worker", "--role", "prefill", "--cluster", "pd", "--listen", ":99999"], "argument --listen: ':99999' is not"),
    (["worker", "--role", "prefill", "--cluster", "pd", "--prefill-chunk", "-3"], "need an integer >= 0, got '-3'"),
    (["worker", "--role", "prefill", "--cluster", "pd", "--connections", "0"], "need an integer >= 1, got '0'"),
    (
        [*WORKER, "--snapshot-policy-arg", "interval_blocks=2"],
        "snapshot 'reuse': its constructor refuses ['interval_blocks']",
    ),
    (
        [*WORKER, "--snapshot-policy", "interval", "--snapshot-policy-arg", "interval_blocks=2.5"],
        "interval_blocks must be an integer >= 0, got 2.5",
    ),
    (["worker", "--role", "prefill", "--cluster", "pd", "--connections", "100"], "--connections 100: at most 64 per"),
    (["worker", "--role", "decode", "--cluster", "pd", "--decode-hold", "-2"], "--decode-hold -2.0: a factor >= 0"),
    (["train", "--text", "t", "--out", "o", "--threads", "0"], "argument --threads: need an integer >= 1"),
    (["train", "--text", "t", "--out", "o", "--sample-tokens", "-5"], "argument --sample-tokens: need an integer >= 0"),
    (["profile", "--gpus-per-instance", "0"], "argument --gpus-per-instance: need an integer >= 1, got '0'"),
    (["profile", "--slo", "nan"], "argument --slo: need a number > 0, got 'nan'"),
    (["sim", "--trace", "mooncake"], "not a shipped trace (mooncake-synthetic, azure-conv, azure-code) or a file"),
    (["sim", "--pd-profile", "missing.json"], "missing.json: No such file or directory"),
    (["sim", "--prfaas-profile", "tableless.json"], "tableless.json: no [prefill] table"),
    (["sim", "--pd-profile", "garbled.json"], "garbled.json: not a profile (Expecting value"),
    (["sim", "--pd-profile", "nameless.json"], "nameless.json: [prefill] has no 'name'"),
    (["sim", "--bandwidth-schedule", "600"], "not TIME_S:GBPS"),
    (
        ["sim", "--trace", "mooncake-synthetic", "--seed", "3", "--load", "0.5"],
        "--load, --seed: for synthetic arrivals only: with --trace, the trace sets the arrivals",
    ),
    (["sim", "--trace", "azure-code", "--rate", "2", "--on-s", "5"], "--rate, --on-s: for synthetic arrivals only"),
    (["sim", "--rate-scale", "2"], "--rate-scale: for a trace only: give --trace"),
    (["sim", "--fixed-threshold"], "--fixed-threshold: for the short-term scheduler, which is off: --scheduler or"),
    (
        ["sim", "--short-term", "default", "--rebalance-period", "60", "--convert-s", "0"],
        "--rebalance-period, --convert-s: for the long-term scheduler, which is off: --scheduler or --long-term runs",
    ),
    (["sim", "--n-decode", "0"], "at least one decode instance"),
    (
        ["sim", "--gpus", "3"],
        "--gpus 3: paper: need n_pd >= 2 and n_homogeneous >= 2, and its 96 GPUs scaled to 3 leave n_pd 0 and "
        "n_homogeneous 0 (18 GPUs or more keep both)",
    ),
    (["sim", "--gpus", "0"], "argument --gpus: need an integer >= 1, got '0'"),
    (["plan", "--threshold-step", "0"], "argument --threshold-step: need an integer >= 1, got '0'"),
    (["plan", "--n-prfaas", "-2"], "argument --n-prfaas: need an integer >= 0, got '-2'"),
    (
        ["sim", "--trace", "mooncake-synthetic", "--snapshot-policy-arg", "interval_blocks=-3"],
        "snapshot 'interval': ValueError: interval_blocks must be an integer >= 0, got -3",
    ),
    (["sim", "--arrivals", "uniform", "--rate", "0.001", "--duration", "5"], "1 request(s), all arriving at once"),
    (["sim", "--threshold", "-5"], "argument --threshold: need an integer >= 0, got '-5'"),
    (["sim", "--spill-tokens", "-1"], "argument --spill-tokens: need an integer >= 0, got '-1'"),
    (["sim", "--max-link-backlog", "-1"], "argument --max-link-backlog: need a number >= 0, got '-1'"),
    (["serve", "--max-link-backlog", "inf"], "argument --max-link-backlog: need a number >= 0, got 'inf'"),
    (["sim", "--n-prfaas", "-1"], "argument --n-prfaas: need an integer >= 0, got '-1'"),
    (["sim", "--duration", "-5"], "argument --duration: need a number > 0, got '-5'"),
    (["sim", "--duration", "nan"], "argument --duration: need a number > 0, got 'nan'"),
    (["sim", "--rate", "0"], "argument --rate: need a number > 0, got '0'"),
    (["sim", "--load", "inf"], "argument --load: need a number > 0, got 'inf'"),
    (["sim", "--on-s", "0"], "argument --on-s: need a number > 0"),
    (["sim", "--off-fraction", "2"], "argument --off-fraction: need a number in [0, 1], got '2'"),
    (["sim", "--length-scale", "0"], "argument --length-scale: need a number > 0"),
    (["sim", "--rtt-ms", "-1"], "argument --rtt-ms: need a number >= 0, got '-1'"),
    (["sim", "--warmup", "x"], "argument --warmup: not a number: 'x'"),
    (["sim", "--warmup", "100", "--duration", "30"], "--warmup 100 s leaves nothing of the"),
    (["sim", "--pipeline-layers", "-1"], "argument --pipeline-layers: need an integer >= 0, got '-1'"),
    (["sim", "--pipeline-layers", "1.5"], "argument --pipeline-layers: not an integer: '1.5'"),
    (["profile", "--model", "nope"], "no model 'nope'"),
    (["profile", "--lengths", "64"], "need two different lengths or more"),
    (["profile", "--lengths", "64,64"], "need two different lengths or more"),
    (["profile", "--lengths", "64,100000"], "--lengths and --decode-context must fit the model's context of 32768"),
    (["profile", "--out", "no-such-folder/p.json"], "argument --out: no folder"),
    (["sim", "--queues-csv", "no-such-folder/q.csv"], "argument --queues-csv: no folder"),
    (["sim", "--queues-png", "no-such-folder/q.png"], "argument --queues-png: no folder"),
    (["sim", "compare", "--plot", "no-such-folder/p.png"], "argument --plot: no folder"),
    (["plan", "--plot", "no-such-folder/p.png"], "argument --plot: no folder"),
    (["plan", "--plot", "p.xyz"], "argument --plot: p.xyz: .xyz is not a figure format: give a .png, .pdf, .svg or"),
    (["plan", "--plot", "noext"], "argument --plot: noext: no suffix to say the figure's format: give a .png, .pdf"),
    (["sim", "--duration", "60", "--queues-png", "q.xyz"], "argument --queues-png: q.xyz: .xyz is not a figure"),
    (["sim", "compare", "--duration", "60", "--policy", "default", "--plot", "c"], "argument --plot: c: no suffix"),
    (["sim", "--queues-csv", "."], "argument --queues-csv: . is a folder: give the file to write"),
    (["profile", "--out", "."], "argument --out: . is a folder: give the file to write"),
    (["profile", "--batches", "0,1"], "need integers >= 1"),
    (["link-emulator", "--target", "localhost"], "not HOST:PORT: 'localhost'"),
    (["link-emulator", "--target", "127.0.0.1:9", "--schedule", "0:fast"], "not a rate schedule"),
    (["link-emulator", "--target", "127.0.0.1:9", "--schedule", "0:1gbit,5:0"], "a rate must be positive, got '0'"),
]


@pytest.mark.parametrize(("argv", "says"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_error_line_and_exit_code_2(
    argv: list[str], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # the missing files are missing here
    save_profiles(tmp_path / "prefill-only.json", H200)
    (tmp_path / "tableless.json").write_text("{}")
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text("{}")
    save_profiles(tmp_path / "pd.json", H200, H20_DECODE)
    (tmp_path / "own-prfaas.toml").write_text('[scheduler]\nprofile = "pd.json"\nprfaas_profile = "tableless.json"\n')
    (tmp_path / "garbled.json").write_text("profile")
    (tmp_path / "nameless.json").write_text('{"prefill": {"points": []}}')
    (tmp_path / "secret").write_text("s" * 32)
    (tmp_path / "secret").chmod(0o600)
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.count("\n") == 1 and err.startswith(f"minifaas {argv[0]}: error: "), err
    assert says in err


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_generate_gives_a_decode_speed_only_when_it_decoded(
    max_tokens: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--model", "kimi-linear-tiny", "--max-tokens", str(max_tokens)]) == 0
    out = capsys.readouterr().out
    speed = re.search(r"decode [0-9.]+ tokens/s", out)
    assert (speed is None) == ("no decode step (the prefill made the one token)" in out) == (max_tokens == 1), out


def test_a_taken_port_is_an_error_before_any_worker_starts(taken_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["serve", "--port", str(taken_port)])
    assert done.value.code == 2
    assert f"cannot listen on 127.0.0.1:{taken_port}: Address already in use" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["generate", "--model", "nope"], "minifaas generate: error: argument --model: no model 'nope'"),
        (["sim", "--n-decode", "0"], "minifaas sim: error: instance counts must be >= 0, with at least one decode"),
    ],
    ids=["a flag's type", "a value read by the command"],
)
def test_the_command_prints_no_traceback(argv: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, "-m", "minifaas.commands.main", *argv], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(says) and done.stderr.count("\n") == 1, done.stderr


def interrupted(argv: list[str], after_cpu_s: float) -> tuple[int, str, str]:
    """Run the command, send it ^C once it has used ``after_cpu_s`` of CPU; its exit code, stdout and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "minifaas.commands.main", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT,
                            signal.SIG_DFL))  # fmt: skip
    try:
        while cpu_seconds(proc.pid) < after_cpu_s and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, out, err


@pytest.mark.slow
def test_ctrl_c_in_a_long_simulation_is_one_line_and_exit_code_130() -> None:
    argv = ["sim", "--gpus", "10000", "--duration", "7200", "--no-progress"]  # about a minute here
    code, out, err = interrupted(argv, 5.0)  # its imports and workload behind it
    assert code == 130 and out == "" and err == "minifaas sim: interrupted\n", err


def test_ctrl_c_while_a_command_imports_torch_is_one_line_and_exit_code_130() -> None:
    argv = ["generate", "--max-tokens", "20000"]  # imports torch, then loads a model and decodes for minutes
    code, out, err = interrupted(argv, 0.4)  # torch's import takes more than a second
    assert code == 130 and out == "" and err == "minifaas generate: interrupted\n", err


def cpu_seconds(pid: int) -> float:
    """User and system CPU of a running process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _floats(value: object) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _floats(v)]
    if isinstance(value, list):
        return [f for v in value for f in _floats(v)]
    return []


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--case", "paper", "--json", "--price-ratio", "1.7"],
        ["sim", "--case", "paper", "--duration", "60", "--json"],
        ["kv-size", "--model", "kimi-linear-tiny", "--model", "qwen3-tiny", "--json", "--lengths", "1000,3000"],
    ],
    ids=lambda argv: argv[0],
)
def test_json_figures_have_six_significant_digits(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    values = _floats(json.loads(capsys.readouterr().out))
    assert values, "no figures"
    assert all(math.isfinite(v) and float(f"{v:.6g}") == v for v in values), values


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_serve_waits_for_a_worker_stops_it_at_once_and_its_children_with_it(
    sig: signal.Signals, tmp_path: Path
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: the hand-started worker never answers
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    argv = ["serve", "--port", "0", "--no-fork-workers", "--secret-file", str(secret),
            "--pd-worker", f"127.0.0.1:{closed.getsockname()[1]}"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "minifaas.commands.main", *argv], stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            if "waiting for the pd worker" in line:
                break
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert children, "the PrfaaS worker it started"
        signalled = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        closed.close()
    assert proc.returncode == 0 and "stopped while starting" in err, err
    print(f"stopped {time.monotonic() - signalled:.1f} s after the signal, where it waited 120 s for the worker")
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]


@pytest.mark.parametrize("second_signal", [False, True], ids=["grace-ends", "second-signal"])
def test_serve_lets_a_stream_in_flight_go_on_for_its_grace_then_cuts_it_and_a_second_signal_cuts_it_at_once(
    second_signal: bool,
) -> None:
    import threading
    import urllib.request

    grace = 120.0 if second_signal else 3.0
    argv = [sys.executable, "-m", "minifaas.commands.main", "serve", "--port", "0", "--no-fork-workers",
            "--log-level", "INFO", "--shutdown-grace", str(grace)]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True)
    log: list[str] = []
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            log.append(line)
            if "serving" in line and "http://" in line:
                break
        url = line.split("http://")[1].split("/")[0]
        threading.Thread(target=log.extend, args=(proc.stderr,), daemon=True).start()
        chunks: list[float] = []  # when each streamed line came
        lines: list[bytes] = []
        body = json.dumps({"prompt": "ROMEO:", "max_tokens": 30000, "ignore_eos": True, "stream": True}).encode()
        request = urllib.request.Request(f"http://{url}/v1/completions", body, {"Content-Type": "application/json"})

        def read() -> None:
            with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=300) as r:
                for line in r:
                    chunks.append(time.monotonic())
                    lines.append(line)

        reader = threading.Thread(target=read)
        reader.start()
        while len(chunks) < 20:
            time.sleep(0.05)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while not any(t > signalled + 1.0 for t in chunks):  # the stream goes on after the signal
            assert proc.poll() is None
            time.sleep(0.05)
        with pytest.raises(OSError):  # but no one new gets in
            urllib.request.urlopen(f"http://{url}/health", timeout=10)
        if second_signal:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        stopped = time.monotonic() - signalled
        reader.join(timeout=30)
    finally:
        proc.kill()
    assert not subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    # The server's grace starts when it takes the signal, a moment after it was sent: a second of slack.
    cut_by = signalled + 1.0 + (grace if not second_signal else 30)
    assert stopped < 60 and chunks[-1] < cut_by, "cut, long before 30,000"
    said = "".join(log)
    assert f"requests in flight have up to {grace:g} s to finish" in said
    assert ("the requests still in flight were cut" in said) == second_signal
    # the client learns why its stream ended: an error in the stream, then the end of the stream
    events = [line.removeprefix(b"data: ").strip() for line in lines if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"], error


def test_a_completion_still_running_when_the_grace_ends_gets_a_503_that_says_why() -> None:
    import threading
    import urllib.error
    import urllib.request

    argv = [sys.executable, "-m", "minifaas.commands.main", "serve", "--port", "0", "--no-fork-workers",
            "--shutdown-grace", "1"]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True)
    answer: list[tuple[int, dict]] = []
    try:
        for line in proc.stderr:  # type: ignore[union-attr]
            if "serving" in line and "http://" in line:
                break
        url = line.split("http://")[1].split("/")[0]
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # type: ignore[union-attr]
        body = json.dumps({"prompt": "ROMEO:", "max_tokens": 30000, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://{url}/v1/completions", body, {"Content-Type": "application/json"})

        def ask() -> None:
            try:
                urllib.request.urlopen(request, timeout=120)
            except urllib.error.HTTPError as e:
                answer.append((e.code, json.loads(e.read())))

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(2.0)  # well into its 30,000 tokens
        proc.send_signal(signal.SIGTERM)
        asker.join(timeout=60)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    status, error = answer[0]
    assert status == 503 and error["error"]["code"] == "shutting_down", answer


def test_a_reader_that_stops_early_ends_a_command_quietly() -> None:
    """``minifaas sim | head -1``: the pipe closes under the command's output; no traceback follows."""
    argv = [sys.executable, "-m", "minifaas.commands.main", "sim", "--case", "paper", "--duration", "60"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()  # as head does once it has its line, here before the command has written any
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert proc.returncode == 128 + signal.SIGPIPE
