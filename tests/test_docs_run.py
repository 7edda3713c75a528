"""Every ``minifaas ...`` command quoted in README.md and docs/*.md runs as written.

Commands that finish (plan, sim, kv-size, generate, profile, demo) run to the
end and must exit 0. Commands that serve until stopped (serve, link-emulator)
must come up, announce where they listen, and stop cleanly on SIGTERM. They run
in an empty scratch folder, far from the repository, so the files they write
(plots, profiles, checkpoints) never touch it and nothing beside a checkout is
needed (the traces and the training text ship in data/ and go by name). A
command that needs a GPU is skipped where there is none, and so is the full
training recipe of the shipped checkpoint (over an hour on two cores;
tests/test_train.py runs the same code with small sizes).
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_docs_commands import CASES, DOCS, commands_in, marked_blocks

pytestmark = pytest.mark.slow  # every documented command run as written, a server start each

LONG_RUNNING = {"serve": "serving", "link-emulator": '"port"', "worker": "waiting for a gateway"}
# commands of a block that tests/test_deploy.py runs whole, as root, with the hosts it sets up
RUN_AS_A_BLOCK = {
    tuple(argv)
    for path in DOCS
    for block in marked_blocks(path.read_text(), "two-hosts-example")
    for argv in commands_in(f"```bash\n{block}```")
}
UNIQUE = sorted({tuple(argv) for _, argv in CASES} - RUN_AS_A_BLOCK)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("scratch")
    (work / "docs").mkdir()  # where the docs' plot commands write
    key = work / "cluster.key"  # the cluster secret, made as docs/DEPLOY.md says
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    return work


def test_no_command_reaches_outside_the_repository() -> None:
    outside = [argv for argv in UNIQUE if any(a.startswith("..") or "/shared/" in a for a in argv)]
    assert outside == [], "the docs quote commands that need files beside the repository"


@pytest.mark.parametrize("argv", UNIQUE, ids=[" ".join(a)[:80] for a in UNIQUE])
def test_command_runs_as_written(argv: tuple[str, ...], scratch: Path) -> None:
    if "cuda" in " ".join(argv) and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if "--launcher ray" in " ".join(argv) and importlib.util.find_spec("ray") is None:
        pytest.skip("needs the ray extra (pip install -e '.[ray]')")
    if argv[0] == "train" and "--steps" not in argv:
        pytest.skip("the shipped checkpoint's full training recipe: over an hour")
    cmd = [sys.executable, "-m", "minifaas.cli", *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if argv[0] not in LONG_RUNNING:
        done = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, f"`minifaas {shlex.join(argv)}` failed:\n{done.stderr[-3000:]}"
        return
    if argv[0] == "link-emulator":
        env_cmd = cmd
    elif argv[0] == "worker":  # any free port instead of the one quoted, which a test machine may be using
        env_cmd = [re.sub(r":\d+$", ":0", a) if i and cmd[i - 1] == "--listen" else a for i, a in enumerate(cmd)]
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
