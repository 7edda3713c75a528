"""The pre-loaded interpreter the suite runs its commands through ends each one as ``python ARGV`` would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from preloaded import Preloaded

SCRIPT = """
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], "name", __name__, "cwd", os.getcwd(), "path0", sys.path[0])
print("env", os.environ.get("ASKED"), "torch loaded", "torch" in sys.modules)
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True))).start()
if sys.argv[1] == "raise":
    raise RuntimeError("boom")
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scripts") / "probe.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def test_a_script_runs_as_main_with_its_argv_cwd_env_and_exit_status(
    python: Preloaded, script: Path, tmp_path: Path
) -> None:
    done = python.run([str(script), "3"], cwd=tmp_path, env={**os.environ, "ASKED": "yes"}, timeout=60)
    assert done.returncode == 3
    assert f"argv ['3'] name __main__ cwd {tmp_path} path0 {script.parent}" in done.stdout
    assert "env yes torch loaded True" in done.stdout  # the imports are the only thing shared
    # non-daemon threads are joined and exit handlers run, in that order, before it ends
    assert done.stdout.index("thread finished") < done.stdout.index("atexit ran")
    assert done.stderr == "to stderr\n"


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(
    python: Preloaded, script: Path, tmp_path: Path
) -> None:
    done = python.run([str(script), "raise"], cwd=tmp_path, env=dict(os.environ), timeout=60)
    assert done.returncode == 1
    assert "RuntimeError: boom" in done.stderr and "Traceback" in done.stderr


def test_a_module_runs_as_python_dash_m_does(python: Preloaded, tmp_path: Path) -> None:
    forked = python.run(
        ["-m", "minifaas.commands.main", "plan", "--help"], cwd=tmp_path, env=dict(os.environ), timeout=60
    )
    fresh = subprocess.run(
        [sys.executable, "-m", "minifaas.commands.main", "plan", "--help"], capture_output=True, text=True
    )
    assert forked.returncode == fresh.returncode == 0
    assert (forked.stdout, forked.stderr) == (fresh.stdout, fresh.stderr)


def test_a_signal_ends_it_as_it_ends_a_process(python: Preloaded, tmp_path: Path) -> None:
    read, write = os.pipe()
    code = "import time; print('up', flush=True); time.sleep(120)"
    (waiting := tmp_path / "wait.py").write_text(code)
    try:
        child = python.start([str(waiting)], cwd=tmp_path, env=dict(os.environ), stdout=write, stderr=write)
    finally:
        os.close(write)
    with open(read) as output:
        assert output.readline() == "up\n"
        assert child.pid != os.getpid()
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.2)
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM


def test_the_interpreter_stand_in_runs_a_command_with_its_callers_stdio_cwd_env_and_status(
    python: Preloaded, script: Path, tmp_path: Path
) -> None:
    exe = str(python.interpreter())
    env = {**os.environ, "ASKED": "client"}
    done = subprocess.run([exe, str(script), "4"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 4
    assert f"argv ['4'] name __main__ cwd {tmp_path} path0 {script.parent}" in done.stdout
    assert "env client torch loaded True" in done.stdout  # forked from the server, not a fresh interpreter
    assert done.stdout.index("thread finished") < done.stdout.index("atexit ran")
    assert done.stderr == "to stderr\n"
    code = "import sys; print(sys.argv[1:], __name__); sys.exit(7)"
    inline = subprocess.run([exe, "-c", code, "a", "b"], capture_output=True, text=True, timeout=60)
    assert (inline.returncode, inline.stdout) == (7, "['a', 'b'] __main__\n")  # python -c, as a fresh one runs it


def test_the_stand_in_passes_signals_on_and_its_command_dies_with_it(python: Preloaded, tmp_path: Path) -> None:
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    (waiting := tmp_path / "wait.py").write_text(code)
    exe = str(python.interpreter())
    for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGTERM goes on to the command; SIGKILL can't, its lifeline can
        client = subprocess.Popen([exe, str(waiting)], stdout=subprocess.PIPE, text=True)
        assert client.stdout is not None
        command = int(client.stdout.readline())
        assert command != client.pid  # the command is the server's child, not the client
        client.send_signal(sig)
        assert client.wait(timeout=30) == -sig
        client.stdout.close()
        for _ in range(300):  # the server reaps it within 50 ms of its end
            if not os.path.exists(f"/proc/{command}"):
                break
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{command}"), f"the command outlived its client ({sig!r})"
    # and the server lives on for the next command, though it had no one to tell of this one's end
    after = python.run(["-c", "print('next')"], cwd=tmp_path, env=dict(os.environ), timeout=60)
    assert (after.returncode, after.stdout) == (0, "next\n")


def test_a_script_that_never_imports_what_it_uses_passes_forked_and_fails_plain(
    tmp_path: Path, python: Preloaded
) -> None:
    """What a fork cannot show: an import the script never makes, which the pre-loaded interpreter made for it
    (tests/test_plain_python.py runs every documented command in a fresh interpreter for this)."""
    script = tmp_path / "script.py"
    script.write_text("import minifaas\n\nprint(minifaas.gateway.gateway.Gateway.__name__)\n")
    forked = python.run([str(script)], cwd=tmp_path, env=dict(os.environ), timeout=60)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert forked.returncode == 0 and forked.stdout == "Gateway\n", forked.stderr
    assert plain.returncode == 1 and "has no attribute 'gateway'" in plain.stderr, plain.stderr
