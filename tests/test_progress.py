"""A long run says which tests took a while, on their own lines, with the run's time so far (tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_a_test_that_takes_a_while_gets_its_own_line(tmp_path: Path) -> None:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_two.py").write_text(
        "import time\n\n"
        "def test_quick():\n    pass\n\n"
        "def test_slow():\n    end = time.perf_counter() + 0.5\n    while time.perf_counter() < end:\n        pass\n"
    )
    env = {**os.environ, "MINIFAAS_NOTE_AFTER_S": "0.3"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    noted = [line for line in done.stdout.splitlines() if " min] " in line]
    assert len(noted) == 1 and noted[0].rstrip().endswith("test_two.py::test_slow"), done.stdout
