"""Which package files one request runs, in every process of ``minifaas serve``, measured by coverage.

    python benchmarks/request_path.py            # a long prompt (to PrfaaS) and a short one (local), a table each
    python benchmarks/request_path.py --json     # the same as one JSON object

Every process starts coverage from a ``sitecustomize`` put first on its path; SIGUSR1 switches each process's
coverage context to the one named in a file, SIGUSR2 saves (workers end by ``os._exit``, which saves nothing).
The server idles first, in context "idle"; then each request runs alone in a context of its own. A file
counts for a request when the request entered a function in it that never ran while idle: heartbeats and the
scheduler's tick run in both, and under load they take branches idle never does (a ping still unanswered when
the watchdog wakes), so new lines alone would count them. A request's lines are those it ran and idle did not.
The link emulator (``emulator/``) stands in for the WAN and is reported apart. ``tests/test_reading_list.py``
holds docs/READING.md to these files.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = {  # name -> (prompt, the route it must take)
    "long": (("ROMEO: But soft, what light through yonder window breaks? " * 60)[:3000], "prfaas"),
    "short": ("JULIET: O Romeo, Romeo, wherefore art thou Romeo?", "local"),
}
SITECUSTOMIZE = """\
import os, signal
if os.environ.get("COVERAGE_PROCESS_START"):
    import coverage
    cov = coverage.process_startup() or coverage.Coverage.current()
    if cov is not None:
        context = os.environ["MINIFAAS_COVERAGE_CONTEXT"]
        signal.signal(signal.SIGUSR1, lambda *_: cov.switch_context(open(context).read()))
        signal.signal(signal.SIGUSR2, lambda *_: cov.save())
"""


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, from /proc: this server's processes and no other's."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        parent = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(parent, []).append(int(pid))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def signal_server(root: int, sig: int) -> None:
    """Send ``sig`` to the server's minifaas processes (each names its role in its title: ``minifaas ...``)."""
    for pid in descendants(root):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"minifaas"):
                os.kill(pid, sig)
        except OSError:
            pass  # gone meanwhile


def switch(root: int, context_file: Path, name: str) -> None:
    context_file.write_text(name)
    signal_server(root, signal.SIGUSR1)
    time.sleep(1)  # every process has taken the signal


def complete(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.load(r)


def measure(idle_s: float = 10.0, max_tokens: int = 8) -> dict[str, dict[str, set[int]]]:
    """Request name -> package file (relative to the repository) -> the lines that request alone ran."""
    import coverage

    with tempfile.TemporaryDirectory(prefix="request-path-") as name:
        tmp = Path(name)
        (tmp / "site").mkdir()
        (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        rc = tmp / "coverage.rc"
        rc.write_text(f"[run]\nparallel = True\nsource = minifaas\ndata_file = {tmp}/cov\n")
        context = tmp / "context"
        context.write_text("startup")
        path = os.pathsep.join(p for p in (str(tmp / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {
            **os.environ,
            "COVERAGE_PROCESS_START": str(rc),
            "PYTHONPATH": path,
            "MINIFAAS_COVERAGE_CONTEXT": str(context),
        }
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = [sys.executable, "-m", "minifaas.commands.main", "serve", "--port", str(port), "--no-fork-workers",
                "--log-level", "warning"]  # fmt: skip
        server = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, server)
            with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
                model = json.load(r)["data"][0]["id"]
            switch(server.pid, context, "idle")
            time.sleep(idle_s)
            for name, (prompt, route) in PROMPTS.items():
                switch(server.pid, context, name)
                got = complete(url, model, prompt, max_tokens)["minifaas"]["route"]
                if got != route:
                    raise RuntimeError(f"the {name} prompt took the route {got!r}, not {route!r}")
            switch(server.pid, context, "after")  # shutdown is no request's
        finally:
            signal_server(server.pid, signal.SIGUSR2)
            time.sleep(2)
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        cov = coverage.Coverage(data_file=str(tmp / "cov"))
        cov.combine([str(tmp)])
        data = cov.get_data()

        def lines(context_name: str) -> dict[str, set[int]]:
            data.set_query_contexts([context_name])
            found = {}
            for measured in data.measured_files():
                relative = Path(measured).resolve().relative_to(ROOT)
                found[str(relative)] = set(data.lines(measured) or ())
            return found

        idle = lines("idle")
        out = {}
        for name in PROMPTS:
            ran = {f: own_lines(ROOT / f, got, idle.get(f, set())) for f, got in lines(name).items()}
            out[name] = {f: got for f, got in ran.items() if got}
        return out


def own_lines(path: Path, ran: set[int], idle: set[int]) -> set[int]:
    """The lines of ``path`` a request ran and idle did not; none unless it entered a function idle never ran."""
    owner = functions(path)
    idle_functions = {owner.get(line, 0) for line in idle}
    if all(owner.get(line, 0) in idle_functions for line in ran):
        return set()
    return ran - idle


def functions(path: Path) -> dict[int, int]:
    """Line -> the first line of the innermost function holding it (lines outside every function: none)."""
    defs = [
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
    ]
    owner = {}
    for node in sorted(defs, key=lambda n: n.lineno):  # an inner function starts later and overwrites its lines
        owner.update(dict.fromkeys(range(node.lineno, node.end_lineno + 1), node.lineno))
    return owner


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 180) -> dict:
    """``server``'s /health body once it answers 200; an error if it exits or is not healthy in ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"minifaas serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return json.load(r)
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"minifaas serve not healthy within {timeout} s")


def core(files: dict[str, set[int]]) -> dict[str, set[int]]:
    """The files of the mechanism: the link emulator left out."""
    return {f: s for f, s in files.items() if not f.startswith("minifaas/emulator/")}


def summary(files: dict[str, set[int]]) -> dict:
    lengths = {f: len((ROOT / f).read_text().splitlines()) for f in files}
    inside = core(files)
    return {"files": len(inside), "file_lines": sum(lengths[f] for f in inside),
            "emulator_files": len(files) - len(inside), "lines_run": sum(map(len, inside.values())),
            "by_file": {f: [len(files[f]), lengths[f]] for f in sorted(inside)}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--idle-s", type=float, default=10.0, help="the idle window before the requests (seconds)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args()
    result = {name: summary(files) for name, files in measure(a.idle_s).items()}
    if a.json:
        print(json.dumps(result))
        return
    for name, s in result.items():
        print(f"{name} prompt: {s['files']} package files outside emulator/ of {s['file_lines']} lines "
              f"({s['lines_run']} distinct lines run; {s['emulator_files']} emulator files beside)")  # fmt: skip
        for f, (ran, length) in s["by_file"].items():
            print(f"  {f:52s} {ran:4d} / {length}")


if __name__ == "__main__":
    main()
