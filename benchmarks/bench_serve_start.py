"""``minifaas serve`` from launch to serving and to stopped, the command as a user runs it, against another checkout.

Each round launches ``python -m minifaas.commands.main serve --port 0`` (the default
clusters: three local CPU workers and the link emulators), waits for its
"serving" line, sends SIGTERM and waits for the exit, which must be 0. Timed:
launch to serving, launch to exited, and the CPU seconds of the whole process
tree (the command, its pre-loaded parent, the workers, the emulators). With
``--against PATH`` the same command of the checkout at PATH runs in
alternating order, with PATH first on Python's path, and the ratios are
printed; without it, this checkout alone. Reported: medians over ``--rounds``.
``--quick``: one round.

    python benchmarks/bench_serve_start.py [--rounds 5] [--against ../other-checkout] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from minifaas import figures
from minifaas.commands.arguments import positive_int

HERE = Path(__file__).resolve().parents[1]
READY = "serving"  # the line serve logs once the HTTP port is open
READY_TIMEOUT_S = 300.0


def tree_cpu_s() -> float:
    """CPU seconds of every reaped descendant so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_start(checkout: Path, scratch: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
    cpu0, t0 = tree_cpu_s(), time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minifaas.commands.main", "serve", "--port", "0"],
        cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    late = threading.Timer(READY_TIMEOUT_S, proc.kill)  # a serve that never comes up ends its output
    late.start()
    ready = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if READY in line:
            ready = time.perf_counter() - t0
            break
    late.cancel()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    stopped = time.perf_counter() - t0
    if ready is None or code != 0:
        raise SystemExit(f"{checkout}: serve did not come up and stop cleanly (exit {code})")
    return {"ready_s": ready, "stopped_s": stopped, "cpu_s": tree_cpu_s() - cpu0}


def run(rounds: int, against: Path | None) -> dict:
    trees = {"this": HERE, **({"against": against} if against else {})}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as scratch:  # what serve writes stays out of both checkouts
        for i in range(rounds):
            for name in list(trees) if i % 2 == 0 else list(trees)[::-1]:
                rows[name].append(one_start(trees[name], scratch))
                print(f"round {i + 1} {name:7}: " + "  ".join(f"{k} {v:.2f}" for k, v in rows[name][-1].items()),
                      flush=True)  # fmt: skip
    median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    out: dict = {"bench": "serve_start", "rounds": rounds, **median}
    print(f"\n{'':8} {'serving s':>9} {'stopped s':>9} {'CPU s':>7}   (medians of {rounds})")
    for name, m in median.items():
        print(f"{name:8} {m['ready_s']:9.2f} {m['stopped_s']:9.2f} {m['cpu_s']:7.2f}")
    if against:
        ratios = {k: median["this"][k] / median["against"][k] for k in median["this"]}
        out["ratios"] = ratios
        print(f"this / against ({against}): serving {ratios['ready_s']:.2f}, stopped {ratios['stopped_s']:.2f}, "
              f"CPU {ratios['cpu_s']:.2f}")  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=positive_int, default=5, help="starts of each checkout, alternating")
    p.add_argument("--against", type=Path, help="another checkout of minifaas to compare with")
    p.add_argument("--quick", action="store_true", help="a smoke run: one round")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    a = p.parse_args()
    if a.against is not None and not (a.against / "minifaas" / "__init__.py").is_file():
        p.error(f"--against {a.against}: not a minifaas checkout")
    out = run(1 if a.quick else a.rounds, a.against.resolve() if a.against else None)
    if a.json:
        print(json.dumps(figures.rounded(out)))


if __name__ == "__main__":
    main()
