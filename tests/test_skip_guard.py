"""Under CI a skip outside the allow-list fails the run (tests/conftest.py's SkipGuard); an allowed one, or any
skip outside CI, does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def run(tmp_path: Path, reason: str, ci: bool) -> subprocess.CompletedProcess[str]:
    test = tmp_path / "test_one_skip.py"
    test.write_text(f"import pytest\n\ndef test_it():\n    pytest.skip({reason!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-rs", str(test)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


@pytest.mark.parametrize(("reason", "ci", "fails"), [
    ("needs root", True, True),
    ("needs root", False, False),
    ("needs a CUDA device (no torch.cuda here)", True, False),
])  # fmt: skip
def test_a_skip_fails_under_ci_unless_allowed(tmp_path: Path, reason: str, ci: bool, fails: bool) -> None:
    done = run(tmp_path, reason, ci)
    assert (done.returncode != 0) == fails, done.stdout[-2000:] + done.stderr[-1000:]
    assert ("SKIP NOT ALLOWED IN CI" in done.stdout) == fails, done.stdout[-2000:]
