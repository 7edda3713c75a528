"""Every ``minifaas ...`` command quoted in README.md and docs/*.md runs as written.

Commands that finish (plan, sim, kv-size, generate, profile, demo) run to the
end and must exit 0. Commands that serve until stopped (serve, link-emulator)
must come up, announce where they listen, and stop cleanly on SIGTERM. They run
in a scratch folder laid out like a checkout (``../shared`` beside it), so the
files they write (plots, profiles) never touch the repository. A command that
needs a GPU is skipped where there is none.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_docs_commands import CASES, ROOT

SHARED = ROOT.parent / "shared"
LONG_RUNNING = {"serve": "serving", "link-emulator": '"port"'}
UNIQUE = sorted({tuple(argv) for _, argv in CASES})


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    top = tmp_path_factory.mktemp("checkout")
    work = top / "work"
    (work / "docs").mkdir(parents=True)
    if SHARED.is_dir():
        (top / "shared").symlink_to(SHARED)
    return work


def _skip_reason(argv: tuple[str, ...]) -> str | None:
    text = " ".join(argv)
    if "cuda" in text and not torch.cuda.is_available():
        return "needs a GPU"
    if "../shared/" in text and not SHARED.is_dir():
        return f"{SHARED} is not present"
    return None


@pytest.mark.parametrize("argv", UNIQUE, ids=[" ".join(a)[:80] for a in UNIQUE])
def test_command_runs_as_written(argv: tuple[str, ...], scratch: Path) -> None:
    reason = _skip_reason(argv)
    if reason:
        pytest.skip(reason)
    cmd = [sys.executable, "-m", "minifaas.cli", *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if argv[0] not in LONG_RUNNING:
        done = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, f"`minifaas {shlex.join(argv)}` failed:\n{done.stderr[-3000:]}"
        return
    if argv[0] == "link-emulator":
        env_cmd = cmd
    else:  # one server at a time; a free port instead of 8000, which a test machine may be using
        env_cmd = [*cmd, "--port", "0"] if "--port" not in argv else [a if a != "8000" else "0" for a in cmd]
    proc = subprocess.Popen(
        env_cmd,
        cwd=scratch,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        seen = []
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if LONG_RUNNING[argv[0]] in line:
                break
        else:
            pytest.fail(f"`minifaas {shlex.join(argv)}` exited before it was ready:\n{''.join(seen)[-3000:]}")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code in (0, -signal.SIGTERM), f"`minifaas {shlex.join(argv)}` did not stop cleanly (exit {code})"
