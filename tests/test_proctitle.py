"""Every process ``minifaas serve`` starts says in ``ps`` what it is, and none outlives the command."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# each process under a served gateway: its role, and the whole title it shows
ROLES = {
    "gateway": r"minifaas serve( .*)?",
    "zygote": r"minifaas zygote",
    "prfaas prefill": r"minifaas prfaas-prefill prfaas-p\d+ :\d+",
    "pd prefill": r"minifaas pd-prefill pd-p\d+ :\d+",
    "pd decode": r"minifaas pd-decode pd-d\d+ :\d+",
    "link emulator": r"minifaas link-emulator( .*)?",
}
pytestmark = pytest.mark.timeout(300)


def title(pid: int) -> str:
    """What ``ps -o args`` shows for ``pid``: its command line, arguments apart by spaces."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode()


def parents() -> dict[int, int]:
    """Every running process's parent."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            found[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])  # the name may hold spaces
    return found


def descendants(root: int) -> list[int]:
    below, tree = [], parents()
    level = [root]
    while level:
        level = [pid for pid, parent in tree.items() if parent in level]
        below += level
    return below


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def role_of(text: str) -> str | None:
    return next((role for role, pattern in ROLES.items() if re.fullmatch(pattern, text)), None)


def start(log: Path) -> subprocess.Popen[bytes]:
    """``minifaas serve`` of the tiny model, its log into ``log``, returned once it serves."""
    argv = [sys.executable, "-m", "minifaas.commands.main", "serve", "--port", "0", "--log-level", "INFO"]
    with log.open("wb") as out:
        proc = subprocess.Popen([*argv, "--model", "kimi-linear-tiny"], stderr=out, start_new_session=True)
    deadline = time.monotonic() + 240
    while "serving" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if "serving" not in log.read_text():
        proc.kill()
        raise AssertionError(f"the server did not start (exit {proc.wait()}):\n{log.read_text()[-3000:]}")
    return proc


def test_every_process_of_a_served_gateway_says_its_role_and_ends_with_it(tmp_path: Path) -> None:
    proc = start(tmp_path / "serve.log")
    try:
        children = descendants(proc.pid)
        titles = {pid: title(pid) for pid in [proc.pid, *children]}
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    roles = {pid: role_of(text) for pid, text in titles.items()}
    assert None not in roles.values(), f"a process that does not say what it is: {titles}"
    assert roles[proc.pid] == "gateway" and set(roles.values()) == set(ROLES), titles
    assert sum(role == "zygote" for role in roles.values()) == 1, titles
    workers = [text for pid, text in titles.items() if roles[pid] not in ("gateway", "zygote", "link emulator")]
    assert len(set(workers)) == len(workers), f"two workers with one title: {workers}"
    assert code == 0
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if running(pid)], "processes left after the gateway stopped"


def test_a_title_leaves_the_environment_readable() -> None:
    script = "import os; from minifaas.proctitle import set_title; set_title('pd-decode', 'pd-d0', '', ':1'); "
    script += "print(open('/proc/self/cmdline', 'rb').read().rstrip(b'\\0').decode()); "
    script += "print(b'MINIFAAS_PROBE=1\\0' in open('/proc/self/environ', 'rb').read(), 'SPT_NOENV' in os.environ)"
    env = {**os.environ, "MINIFAAS_PROBE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout.splitlines() == ["minifaas pd-decode pd-d0 :1", "True False"], done.stderr
