"""Every ``minifaas ...`` command quoted in README.md and docs/*.md runs as written.

Commands that finish (plan, sim, kv-size, generate, profile, demo) run to the
end and must exit 0. Commands that serve until stopped (serve, link-emulator)
must come up, announce where they listen, and stop cleanly on SIGTERM. They run
in an empty scratch folder, far from the repository, so the files they write
(plots, profiles, checkpoints) never touch it and nothing beside a checkout is
needed (the traces and the training text ship in data/ and go by name; the
folder links to the checkout's examples/, whose policies the commands quoted to
run from the project root name). A command that needs a GPU is skipped where there is none. The full training
recipe of the shipped checkpoint (over an hour on two cores) runs its first
step and stops there, saved (``--stop-at 1``); tests/test_train.py checks that
a stopped run resumes to the same weights as one that never stopped. They run two at a
time, in sorted order, each as ``python -m minifaas.commands.main ...`` in a process
forked from the pre-loaded interpreter (``python`` in conftest.py); a command
that reads a file another writes (``--out``) waits for that one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shlex
import signal
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from preloaded import Preloaded
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
READY_WITHIN_S = 300.0  # a server that has not announced itself by then is killed and fails


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("scratch")
    (work / "docs").mkdir()  # where the docs' plot commands write
    # the commands quoted to run from the project root import a policy from its examples (docs/POLICIES.md)
    (work / "examples").symlink_to(Path(__file__).resolve().parent.parent / "examples")
    key = work / "cluster.key"  # the cluster secret, made as docs/DEPLOY.md says
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    return work


def test_no_command_reaches_outside_the_repository() -> None:
    outside = [argv for argv in UNIQUE if any(a.startswith("..") or "/shared/" in a for a in argv)]
    assert outside == [], "the docs quote commands that need files beside the repository"


def _skip_reason(argv: tuple[str, ...]) -> str | None:
    if "cuda" in " ".join(argv) and not torch.cuda.is_available():
        return "needs a GPU"
    if "--launcher ray" in " ".join(argv) and importlib.util.find_spec("ray") is None:
        return "needs the ray extra (pip install -e '.[ray]')"
    return None


def _as_run(argv: tuple[str, ...]) -> list[str]:
    """The command as it runs here: the shipped checkpoint's full recipe (no ``--steps``: over an hour)
    stops, saved, after its first step."""
    return [*argv, "--stop-at", "1"] if argv[0] == "train" and "--steps" not in argv else list(argv)


def _written(argv: tuple[str, ...]) -> str | None:
    """The file a command writes with ``--out FILE``, which a later command may read."""
    return argv[argv.index("--out") + 1] if "--out" in argv else None


@dataclass(frozen=True, slots=True)
class Ran:
    code: int | None  # the exit status; None: a server killed for not coming up in time
    output: str
    ready: bool = True  # a server announced where it listens


def _run(python: Preloaded, argv: tuple[str, ...], scratch: Path, needs: list[Future[Ran]]) -> Ran:
    for before in needs:  # the command that writes a file this one reads goes first
        before.result()
    cmd = ["-m", "minifaas.commands.main", *_as_run(argv)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if argv[0] not in LONG_RUNNING:
        done = python.run(cmd, cwd=scratch, env=env, timeout=600)
        return Ran(done.returncode, done.stderr)
    if argv[0] == "worker":  # any free port instead of the one quoted, which a test machine may be using
        cmd = [re.sub(r":\d+$", ":0", a) if i and cmd[i - 1] == "--listen" else a for i, a in enumerate(cmd)]
    elif argv[0] == "serve":  # a free port instead of 8000, which a test machine may be using
        cmd = [*cmd, "--port", "0"] if "--port" not in argv else [a if a != "8000" else "0" for a in cmd]
    read, write = os.pipe()
    try:
        proc = python.start(cmd, cwd=scratch, env=env, stdout=write, stderr=write, new_session=True)
    finally:
        os.close(write)
    late = threading.Timer(READY_WITHIN_S, proc.kill)  # a server that never comes up ends its output
    late.start()
    seen: list[str] = []
    try:
        with open(read, errors="replace") as output:
            for line in output:
                seen.append(line)
                if LONG_RUNNING[argv[0]] in line:
                    break
            ready = bool(seen) and LONG_RUNNING[argv[0]] in seen[-1]
            late.cancel()
            proc.send_signal(signal.SIGTERM)
            try:
                code: int | None = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = None
    finally:
        late.cancel()
        proc.kill()  # a no-op once it has ended
    return Ran(code, "".join(seen)[-3000:], ready)


@pytest.fixture(scope="module")
def runs(
    scratch: Path, request: pytest.FixtureRequest, python: Preloaded
) -> Iterator[dict[tuple[str, ...], Future[Ran]]]:
    """The selected commands, two at a time in their sorted order: most of them spend their time
    starting a process, a model or a server, so a pair keeps both cores busy. A command that reads
    a file another writes (``--out prof.json``) waits for it."""
    chosen = [
        item.callspec.params["argv"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_command_runs_as_written"
    ]
    writers: dict[str, Future[Ran]] = {}
    futures: dict[tuple[str, ...], Future[Ran]] = {}
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        for argv in chosen:
            if _skip_reason(argv):
                continue
            needs = [writers[a] for a in argv[1:] if a in writers]
            futures[argv] = pool.submit(_run, python, argv, scratch, needs)
            if (out := _written(argv)) is not None:
                writers[out] = futures[argv]
        yield futures
    finally:  # after a failure under -x, the runs not started yet are dropped
        pool.shutdown(cancel_futures=True)


def test_a_file_is_written_before_the_commands_that_read_it_run() -> None:
    written = {out: i for i, argv in enumerate(UNIQUE) if (out := _written(argv))}
    read = [(i, a) for i, argv in enumerate(UNIQUE) for a in argv[1:] if a in written and _written(argv) != a]
    assert read, "no documented command reads a file another writes (then this check is pointless)"
    for i, a in read:
        assert written[a] < i, f"`{shlex.join(UNIQUE[i])}` would run before the command that writes {a}"


@pytest.mark.parametrize("argv", UNIQUE, ids=[" ".join(a)[:80] for a in UNIQUE])
def test_command_runs_as_written(argv: tuple[str, ...], runs: dict[tuple[str, ...], Future[Ran]]) -> None:
    if reason := _skip_reason(argv):
        pytest.skip(reason)
    ran = runs[argv].result()
    shown = f"`minifaas {shlex.join(argv)}`"
    if argv[0] not in LONG_RUNNING:
        assert ran.code == 0, f"{shown} failed:\n{ran.output[-3000:]}"
        return
    assert ran.ready, (
        f"{shown} exited (or did not come up within {READY_WITHIN_S:.0f} s) before it was ready:\n{ran.output}"
    )
    assert ran.code in (0, -signal.SIGTERM), f"{shown} did not stop cleanly (exit {ran.code})"
