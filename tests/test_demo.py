"""``minifaas demo`` into a pipe, as a script or CI sees it: start-up lines, whole table rows, tables apart,
and no log line among them (stdout and stderr in one file, as a terminal shows both)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from preloaded import Preloaded

from minifaas.commands.demo import CLIENTS, DemoRequest, _client

ROOT = Path(__file__).resolve().parent.parent

NAMES = ("prfaas-p0", "pd-p0", "pd-d0", "prfaas->pd")
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ (DEBUG|INFO|WARNING|ERROR) ")
CODECS = {"none", "lossless", "fp8", "int8"}


def _demo(python: Preloaded, tmp_path: Path, *flags: str) -> list[str]:
    """The demo's lines, stdout and stderr interleaved as they were written."""
    argv = ["-m", "minifaas.commands.main", "demo", "--short", "2", "--long", "1", "--long-tokens", "700", *flags]
    env = {**os.environ, "COLUMNS": "80"}  # what rich would wrap at; the demo must not
    out = tmp_path / "output"
    with out.open("wb") as f:
        child = python.start(argv, cwd=tmp_path, env=env, stdout=f.fileno(), stderr=f.fileno())
        code = child.wait(600)
    text = out.read_text()
    assert code == 0, text[-3000:]
    return text.splitlines()


@pytest.mark.slow
def test_demo_output_into_a_pipe_reads_line_by_line(python: Preloaded, tmp_path: Path) -> None:
    lines = _demo(python, tmp_path, "--max-tokens", "4")
    assert not [line for line in lines if LOG_LINE.match(line)], "log lines in the demo's output:\n" + "\n".join(lines)
    for name in NAMES:  # each process shown starting, then ready
        starting = next(i for i, line in enumerate(lines) if line.startswith(f"{name} (") and "starting" in line)
        ready = next(i for i, line in enumerate(lines) if line.startswith(f"{name} (") and "ready after" in line)
        assert starting < ready
    assert any(line.startswith("ready in ") and "torch reference kernels;" in line for line in lines), lines
    assert any(re.search(r"; the dashboard: http://127\.0\.0\.1:\d+/dashboard$", line) for line in lines), lines
    top = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    bottom = next(i for i, line in enumerate(lines) if line.startswith("└") and i > top)
    assert all(line[:1] in "┏┃┡│└" for line in lines[top : bottom + 1]), lines[top : bottom + 1]  # nothing inside
    rows = {line.split()[1]: line for line in lines if line.startswith("│ short-") or line.startswith("│ long-")}
    assert set(rows) == {"short-0", "short-1", "long-0"}, lines
    assert all("done" in row for row in rows.values()), rows  # one row, one line: nothing wrapped
    assert "local" in rows["short-0"] and "prfaas" in rows["long-0"]
    assert any(line.startswith("┃ request") and line.rstrip("┃ ").endswith("text") for line in lines), lines
    snippets = {name: row.rstrip("│ ").rsplit("│", 1)[-1].strip() for name, row in rows.items()}
    assert all(snippets.values()), snippets  # the start of each answer, sampled
    summary = next(i for i, line in enumerate(lines) if line.strip() == "summary by route")
    assert lines[summary - 1] == "" and lines[summary - 2].startswith("└"), "the summary's title is glued to a table"
    header = next(line for line in lines[summary:] if line.startswith("┃ route"))
    assert [c.strip() for c in header.strip("┃ ").split("┃")][4:7] == ["KV state", "on the wire", "codec"]
    prfaas = next(line for line in lines[summary:] if line.startswith("│ prfaas"))
    state, wire, codec = [c.strip() for c in prfaas.strip("│ ").split("│")][4:7]
    assert state.endswith(" MB") and wire.endswith(" MB") and float(state[:-3]) > 0 and float(wire[:-3]) > 0
    assert codec in CODECS
    throughput = next(line for line in lines if line.startswith("throughput: "))
    tokens, wall, rate, per_cpu, cpu = map(float, re.findall(r"\d+(?:\.\d+)?", throughput)[:5])
    assert tokens > 0 and wall > 0.005 and cpu > 0.005, throughput

    def near(printed: float, total: float) -> bool:  # the rate from a total printed to 0.01, the rate to 0.1
        return tokens / (total + 0.005) - 0.05 <= printed <= tokens / (total - 0.005) + 0.05

    assert near(rate, wall) and near(per_cpu, cpu), throughput


@pytest.mark.slow
def test_demo_log_level_shows_the_workers_lines_and_one_short_kernels_line(python: Preloaded, tmp_path: Path) -> None:
    lines = _demo(python, tmp_path, "--max-tokens", "2", "--log-level", "info")
    kernels = [line for line in lines if "minifaas.worker INFO worker pd-d0 on cpu:" in line]
    assert len(kernels) == 1 and kernels[0].endswith("on cpu: torch kernels"), kernels


def test_the_demo_checks_its_devices_as_serve_does() -> None:
    """Asked for a GPU this machine lacks, the demo stops in one line before starting anything."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    done = subprocess.run(
        [sys.executable, "-m", "minifaas.commands.main", "demo", "--prfaas-device", "cuda:0", "--pd-device", "cuda:0"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and "no device cuda:0" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_demo_dashboard_sends_a_steady_mix_until_its_duration(python: Preloaded, tmp_path: Path) -> None:
    flags = ("--dashboard", "--duration", "12", "--dip-every", "5", "--dip-seconds", "2")
    lines = _demo(python, tmp_path, "--max-tokens", "4", *flags)
    ready = next(line for line in lines if line.startswith("ready in "))
    assert re.search(r"; the dashboard: http://127\.0\.0\.1:\d+/dashboard$", ready), ready
    assert any("the link dips to a 20th of 50mbit for 2 s every 5 s; stopping after 12 s" in line for line in lines)
    summary = next(i for i, line in enumerate(lines) if line.strip() == "summary by route")
    served = {line.split()[1]: int(line.split()[3]) for line in lines[summary:] if line.startswith("│ ")}
    assert set(served) == {"local", "prfaas"} and sum(served.values()) > 2 * CLIENTS, served  # they went on sending
    assert lines[-1].startswith("stopped: all processes shut down")


@pytest.mark.parametrize(("threshold", "long_tokens"), [(512, 2000), (512, 100), (10, 2000), (0, 1)])
def test_the_steady_mix_draws_prompts_on_either_side_of_any_threshold(threshold: int, long_tokens: int) -> None:
    args = argparse.Namespace(threshold=threshold, long_tokens=long_tokens)
    rows: list[DemoRequest] = []

    async def send(row: DemoRequest, seed: int) -> None:
        if len(rows) == 40:
            raise asyncio.CancelledError  # as the demo's end cancels each client

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_client(0, args, send, rows))
    longs = [r.prompt_chars for r in rows if r.name.startswith("long")]
    shorts = [r.prompt_chars for r in rows if r.name.startswith("short")]
    assert len(longs) == len(shorts) == 20
    assert all(threshold <= c <= max(threshold, 3 * long_tokens) for c in longs), longs
    assert all(1 <= c <= max(1, threshold // 2) for c in shorts), shorts
