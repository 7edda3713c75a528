"""``minifaas demo`` into a pipe, as a script or CI sees it: start-up lines, whole table rows, tables apart."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from preloaded import Preloaded

NAMES = ("prfaas-p0", "pd-p0", "pd-d0", "prfaas->pd")


@pytest.mark.slow
def test_demo_output_into_a_pipe_reads_line_by_line(python: Preloaded, tmp_path: Path) -> None:
    argv = ["demo", "--short", "2", "--long", "1", "--long-tokens", "700", "--max-tokens", "4"]
    env = {**os.environ, "COLUMNS": "80"}  # what rich would wrap at; the demo must not
    done = python.run(["-m", "minifaas.commands.main", *argv], cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for name in NAMES:  # each process shown starting, then ready
        starting = next(i for i, line in enumerate(lines) if line.startswith(f"{name} (") and "starting" in line)
        ready = next(i for i, line in enumerate(lines) if line.startswith(f"{name} (") and "ready after" in line)
        assert starting < ready
    rows = {line.split()[1]: line for line in lines if line.startswith("│ short-") or line.startswith("│ long-")}
    assert set(rows) == {"short-0", "short-1", "long-0"}, lines
    assert all("done" in row for row in rows.values()), rows  # one row, one line: nothing wrapped
    assert "local" in rows["short-0"] and "prfaas" in rows["long-0"]
    assert any(line.startswith("┃ request") and line.rstrip("┃ ").endswith("text") for line in lines), lines
    snippets = {name: row.rstrip("│ ").rsplit("│", 1)[-1].strip() for name, row in rows.items()}
    assert all(snippets.values()), snippets  # the start of each answer, sampled
    summary = next(i for i, line in enumerate(lines) if line.strip() == "summary by route")
    assert lines[summary - 1] == "" and lines[summary - 2].startswith("└"), "the summary's title is glued to a table"
