"""The device check for a one-GPU machine with no network, in at most 8 minutes; one JSON file of results.

    bash benchmarks/gpu_check.sh                       # on the GPU machine: writes gpu_check.json
    python benchmarks/gpu_check.py --dry-run           # every step here on the CPU, tiny sizes

Steps, each time-boxed (a step that overruns is recorded as "timeout", never hangs the run):
install (from wheels in .whl/ when there, else what the environment has; never the network), the
``-m gpu`` tests, then the probes of ``gpu_probe.py``: fla against the torch reference per preset and
for the trained checkpoint, greedy exactness, device-to-host pipelining, runtime tokens/s per model,
decode batching, and ``minifaas serve`` on the device (TTFT per route, through ``bench_serve``).
A step fails when it exits non-zero, overruns, or reports ``"ok": false`` (a kernel error or a token
beyond the probe's tolerance); the run then exits 1 and names each failed step and why.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = str(ROOT / "benchmarks" / "gpu_probe.py")
MODELS = ("shakespeare-qwen3.5", "kimi-linear-tiny", "qwen3.5-tiny", "qwen3-tiny", "mimo-v2-tiny")
BUDGET_S = 480  # the whole run


def step(name: str, argv: list[str], timeout: float, results: dict, env: dict | None = None) -> dict:
    """Run one step in its own process; its last JSON line (or its tail) goes into ``results``."""
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
        record: dict = {"rc": done.returncode}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if lines:
            record["result"] = json.loads(lines[-1])
        if done.returncode != 0 or not lines:
            record["tail"] = (done.stdout + done.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        record = {"rc": "timeout", "limit_s": timeout, "tail": out[-1500:]}
    record["seconds"] = round(time.perf_counter() - started, 2)
    results[name] = record
    print(f"{name:<32} {record['rc']!s:>8} {record['seconds']:>7.1f} s", flush=True)
    return record


def passed(record: dict) -> bool:
    result = record.get("result")
    return record["rc"] == 0 and not (isinstance(result, dict) and result.get("ok") is False)


def why(record: dict) -> str:
    """A failed step's reason: what its probe said failed, else the last line it wrote."""
    result = record.get("result")
    if isinstance(result, dict) and result.get("failures"):
        return "; ".join(result["failures"])
    lines = [line for line in record.get("tail", "").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {record['rc']}"


def install(python: str, dry_run: bool) -> list[str]:
    wheels = ROOT / ".whl"
    if dry_run:  # found, not imported: fla and triton never load on the CPU
        found = "{m: bool(u.find_spec(m)) for m in ('fla', 'triton')}"
        return [python, "-c", f"import importlib.util as u, json; print(json.dumps({found}))"]
    if wheels.is_dir() and any(wheels.glob("*.whl")):
        return [python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                "-e", f"{ROOT}[gpu,test]"]  # fmt: skip
    # no wheels: the environment must already hold the gpu extra (the check never reaches the network)
    code = "import fla, triton, torch, json; print(json.dumps({'fla': fla.__version__, 'torch': torch.__version__}))"
    return [python, "-c", code]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU, tiny sizes, one model")
    p.add_argument("--quick", action="store_true", help="the fewest models and steps (implied by --dry-run)")
    p.add_argument("--out", default="gpu_check.json", help="the results file (default: gpu_check.json)")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter each step runs in, a fresh process per step (default: this one)")  # fmt: skip
    a = p.parse_args(argv)
    py, probe = a.python, [a.python, PROBE]
    quick = a.quick or a.dry_run
    device = "cpu" if a.dry_run else "cuda:0"
    tokens = "96" if quick else "2048"
    # the dry run only proves that each step runs: one model, Kimi Linear (KDA, the kernels fla adds most of)
    models = MODELS[1:2] if a.dry_run else MODELS[:2] if quick else MODELS
    results: dict = {"device": device, "dry_run": a.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    deadline = time.perf_counter() + BUDGET_S

    def left(limit: float) -> float:
        return max(1.0, min(limit, deadline - time.perf_counter()))

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    step("install", install(py, a.dry_run), left(120), results, env)
    if not a.dry_run:
        step("nvidia-smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"],
             left(15), results, env)  # fmt: skip
    step("pytest -m gpu", [py, "-m", "pytest", "-q", "-m", "gpu", "-rs", "tests/test_gpu.py"],
         left(30 if a.dry_run else 200), results, env)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            ref = str(Path(tmp) / f"{model}.pt")
            common = ["--model", model, "--tokens", tokens]
            step(f"reference {model}", [*probe, "reference", *common, "--device", "cpu", "--file", ref], left(60),
                 results, env)  # fmt: skip
            step(f"kernels {model}", [*probe, "kernels", *common, "--device", device, "--file", ref], left(90),
                 results, env)  # fmt: skip
            step(f"runtime {model}", [*probe, "runtime", *common, "--device", device], left(60), results, env)
    step("exactness", [*probe, "exactness", "--tokens", "64", "--device", device], left(90), results, env)
    step("pipelining", [*probe, "pipelining", "--tokens", tokens, "--device", device], left(60), results, env)
    streams = "4" if a.dry_run else "16"
    step("decode batching", [*probe, "decode", "--tokens", "64", "--streams", streams, "--device", device], left(60),
         results, env)  # fmt: skip
    serve = [py, "benchmarks/bench_serve.py", "--quick", "--json"]
    if not a.dry_run:
        serve += ["--device", device]
    step("served TTFT per route", serve, left(120), results, env)
    results["seconds"] = round(BUDGET_S - (deadline - time.perf_counter()), 1)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    failed = [k for k, v in results.items() if isinstance(v, dict) and not passed(v)]
    print(f"wrote {a.out} in {results['seconds']} s; {len(failed)} step(s) failed: {', '.join(failed) or 'none'}")
    for name in failed:
        print(f"  {name}: {why(results[name])}")
    if a.json:
        print(json.dumps({"failed": failed, "seconds": results["seconds"]}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
