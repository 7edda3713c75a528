"""Every script in examples/ runs to the end and prints its conclusion (smoke tests, so none rots).

The examples start together, each a process forked from the pre-loaded
interpreter (``python`` in conftest.py), and are checked one by one: each is a
few seconds of CPU, and running them side by side keeps the whole file short
even on busy cores.
"""

from __future__ import annotations

import ast
import os
import subprocess
import time
from pathlib import Path

import pytest
from preloaded import Preloaded

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXPECTED = {
    "disaggregated_by_hand": "same tokens as transformers' generate(): True",
    "kv_over_emulated_link": "received state equals the prefilled state: True",
    "prefix_cache_hit": "output with the hit equals the cold output: True",
    "plan_paper_case": "throughput vs homogeneous: +",
    "simulate_trace": "every request completed",
    "custom_router": "least-loaded offloads",
    "openai_client": '"route": "prfaas"',
}
TIMEOUT_S = 170

pytestmark = [pytest.mark.timeout(TIMEOUT_S + 30), pytest.mark.slow]  # every example run whole


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory, python: Preloaded) -> dict[str, subprocess.CompletedProcess[str]]:
    cwd = tmp_path_factory.mktemp("examples")  # nothing may depend on the working directory
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    running = {name: python.start([str(EXAMPLES / f"{name}.py")], cwd=cwd, env=env) for name in EXPECTED}
    done = {}
    deadline = time.monotonic() + TIMEOUT_S
    for name, process in running.items():
        note = ""
        try:
            out, err = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            note = f"\n(killed after {TIMEOUT_S} s)"
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err + note)
    return done


def test_every_example_is_covered_and_says_how_to_run_it() -> None:
    scripts = sorted(p.stem for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(EXPECTED)
    for name in scripts:
        source = (EXAMPLES / f"{name}.py").read_text()
        doc = ast.get_docstring(ast.parse(source)) or ""
        assert f"python examples/{name}.py" in doc, f"{name}: the docstring should say how to run it"
        assert len(source.splitlines()) <= 90, f"{name}: an example should stay short"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str, outputs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    result = outputs[name]
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    assert EXPECTED[name] in result.stdout, f"{name} printed:\n{result.stdout}\n{result.stderr[-3000:]}"
