"""Every command that draws, on an install without matplotlib (the ``plot`` extra): its figures' one line in
place of each figure, and no traceback. Each runs in a child whose ``import matplotlib`` fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from minifaas.commands.main import main; "
INSTALL = "matplotlib is not installed (pip install -e '.[plot]')"


def without_matplotlib(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    code = NO_MATPLOTLIB + f"raise SystemExit(main({list(argv)!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "argv",
    [
        ("sim", "compare", "--case", "paper", "--duration", "60", "--policy", "default", "--plot", "out.png"),
        ("sim", "--case", "paper", "--duration", "60", "--queues-png", "out.png"),
        ("plan", "--case", "paper", "--plot", "out.png"),
    ],
    ids=["sim-compare", "sim-queues", "plan"],
)
def test_a_figure_without_matplotlib_is_one_line_saying_what_to_install(tmp_path: Path, argv: tuple[str, ...]) -> None:
    run = without_matplotlib(tmp_path, *argv)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "ModuleNotFoundError" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == f"no plot out.png: {INSTALL}"
    assert run.stdout.strip()  # the table or the figures were still printed
    assert not (tmp_path / "out.png").exists()


def test_the_child_really_lacks_matplotlib(tmp_path: Path) -> None:
    """The same child, drawing directly, fails as an install without the extra would: the test above is fair."""
    code = NO_MATPLOTLIB + "import minifaas.sim.comparison as c; c.plot_comparison({}, 'x.png')"
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "ModuleNotFoundError" in run.stderr
