"""The device check: every step of ``gpu_probe.py`` in order, each in its own process group with its own time limit,
its JSON line appended to one file as it ends, so a late failure or a timeout loses nothing before it.

    bash benchmarks/gpu_check.sh --out $OUT/gpu_check.jsonl     # on the GPU machine, from the wheels in .whl/
    python benchmarks/gpu_check.py --dry-run --out check.jsonl  # every step here on the CPU, tiny sizes

Order: versions and nvidia-smi; every hybrid family's CPU float32 reference; per family the device's kernels
against it (the label asserted ``fla``, the Triton kernels listed, float32 with Triton's dots in IEEE precision
judged at 1e-4, one autotune config per kernel; bfloat16 reported); bitwise data movement in bfloat16; a model
the size of Qwen3.5-0.8B (prefill by length, memory, a streamed prefill, decode by batch, rows sized under a
one-third memory fraction); a served greedy request. A step fails when it exits non-zero, overruns, or reports
``"ok": false``; the check then exits 1 naming each. Without CUDA, every step outside ``--dry-run`` fails rather
than skips. A failed step's record keeps the end of its output, where its progress notes say how far it got.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = str(ROOT / "benchmarks" / "gpu_probe.py")
FAMILIES = ("kimi-linear-tiny", "qwen3.5-tiny", "models/families/qwen3_next.json")
BUDGET_S = 540


@dataclass
class Step:
    name: str
    argv: list[str]
    limit: float  # seconds it may take
    floor: float  # seconds kept back for it while earlier steps run
    env: dict[str, str] = field(default_factory=dict)


def run_step(step: Step, timeout: float, out: Path) -> dict:
    """``step`` in a new process group, killed whole at ``timeout``; its record appended to ``out``."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        **step.env,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    started = time.perf_counter()
    proc = subprocess.Popen(
        step.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the step's workers and servers too
        stdout, stderr = proc.communicate()
        rc = "timeout"
    record: dict = {
        "step": step.name,
        "rc": rc,
        "seconds": round(time.perf_counter() - started, 2),
        "limit_s": round(timeout, 1),
    }
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if lines:
        record["result"] = json.loads(lines[-1])
    if rc != 0 or not lines:
        record["tail"] = (stdout + stderr)[-3000:]
    record["ok"] = rc == 0 and bool(lines) and record["result"].get("ok") is True
    with out.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"{step.name:<44} {'ok' if record['ok'] else 'FAILED':>6} {record['seconds']:>7.1f} s", flush=True)
    return record


def steps(python: str, dry_run: bool, tmp: str) -> list[Step]:
    device = "cpu" if dry_run else "cuda:0"
    probe = [python, PROBE]
    # correctness: fp32 dots exact, so 1e-4 judges the kernels and not tf32 rounding; one autotune config per
    # kernel, since compiling every config of every fla kernel takes minutes (the first device run timed out so)
    exact = {"TRITON_F32_DEFAULT": "ieee", "MINIFAAS_PROBE_ONE_CONFIG": "1"}
    quick = {"MINIFAAS_PROBE_ONE_CONFIG": "1"}
    families = FAMILIES[:1] if dry_run else FAMILIES
    tokens = ["--tokens", "96" if dry_run else "256", "--file", tmp]
    out = [
        Step("env", [*probe, "env", "--device", device], 60, 10),
        Step("reference", [*probe, "reference", "--model", ",".join(families), *tokens], 90, 20),
    ]
    for model in families:
        name = Path(model).stem
        kernels = [*probe, "kernels", "--model", model, *tokens, "--device", device]
        out.append(Step(f"kernels {name} float32", kernels, 120, 30, exact))
        if model == FAMILIES[0]:
            out.append(Step(f"kernels {name} bfloat16", [*kernels, "--dtype", "bfloat16"], 90, 20, quick))
    out.append(Step("movement bfloat16", [*probe, "movement", "--device", device, "--tokens", "300"], 90, 20, quick))
    scale = ["--lengths", "64,128", "--stream-tokens", "256", "--batches", "1,4", "--shrink"] if dry_run else []
    out.append(Step("scale qwen3.5-0.8b", [*probe, "scale", "--device", device, *scale], 240, 90))
    out.append(Step("serve", [*probe, "serve", "--device", device, "--model", "shakespeare-qwen3.5"], 180, 60))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU, tiny sizes, one model")
    p.add_argument("--out", default="gpu_check.jsonl", help="one JSON line per step, appended as each ends")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check (default: %(default)s)")
    p.add_argument("--python", default=sys.executable, help="the interpreter each step runs in (default: this one)")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    deadline = time.perf_counter() + a.budget
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        plan = steps(a.python, a.dry_run, tmp)
        for i, step in enumerate(plan):
            kept_back = sum(s.floor for s in plan[i + 1 :])
            timeout = max(step.floor, min(step.limit, deadline - time.perf_counter() - kept_back))
            if timeout <= 1:
                record = {"step": step.name, "rc": "not run", "ok": False, "tail": "no time left in the budget"}
                with out.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            else:
                record = run_step(step, timeout, out)
            if not record["ok"]:
                failed.append(step.name)
    print(f"wrote {out}; {len(failed)} step(s) failed{': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
