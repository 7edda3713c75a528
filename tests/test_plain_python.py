"""Every documented command under a plain interpreter, as a reader types it, not forked from a pre-loaded one.

The runs-as-written tests (test_docs_run, test_benchmarks_run, test_examples) fork each command from an
interpreter that has imported torch and most of minifaas already (tests/preloaded.py), so a script that
reaches a module it never imports passes there. Here each is a fresh process from a scratch folder: every
``minifaas`` subcommand through the installed console script, with a cheap real run where there is one
(plan, sim, kv-size) and ``--help`` otherwise (its module and everything it imports load); every
benchmark with ``--help``; the examples that need no model run whole, the others (they take no flags) are
executed under another name than ``__main__``, so their module-level imports run but not their main.
Two at a time. ``serve``, ``worker`` and ``generate`` also run whole as plain processes elsewhere
(tests/test_proctitle.py, tests/hand_started.py, tests/test_model_sources.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from test_examples import EXPECTED

from minifaas.commands.main import COMMANDS

pytestmark = pytest.mark.slow  # a fresh interpreter per command, most of them importing torch

ROOT = Path(__file__).resolve().parent.parent
MINIFAAS = Path(sys.executable).with_name("minifaas")  # the console script pip installs beside this python
REAL_RUNS = {
    "plan": ["--case", "paper", "--json"],
    "sim": ["--case", "paper", "--duration", "60", "--json"],
    "kv-size": ["--model", "kimi-linear-tiny", "--json"],
}
BENCHMARK_LIBRARIES = ("synthetic.py",)  # imported by benchmarks and tests, no command of its own
WHOLE_EXAMPLES = ("plan_paper_case", "simulate_trace")  # no model to load: a second or less each
# ``python examples/x.py`` without its main: the script's folder first on sys.path, as python puts it there
IMPORT_ONLY = "import os, runpy, sys; sys.path[0] = os.path.dirname(sys.argv[1]); runpy.run_path(sys.argv[1])"


def _commands() -> dict[str, list[str]]:
    out = {f"minifaas {name}": [str(MINIFAAS), name, *REAL_RUNS.get(name, ["--help"])] for name in COMMANDS}
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if path.name not in BENCHMARK_LIBRARIES:
            out[f"benchmarks/{path.name}"] = [sys.executable, str(path), "--help"]
    for path in sorted((ROOT / "examples").glob("*.py")):
        whole = path.stem in WHOLE_EXAMPLES
        out[f"examples/{path.name}"] = [sys.executable, *([] if whole else ["-c", IMPORT_ONLY]), str(path)]
    return out


COMMAND_LINES = _commands()


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """The selected commands, two at a time."""
    scratch = tmp_path_factory.mktemp("plain")  # nothing may depend on the working directory
    chosen = [
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_runs_under_a_plain_interpreter"
    ]

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, cwd=scratch, env=dict(os.environ), timeout=300)

    pool = ThreadPoolExecutor(max_workers=2)
    try:
        yield {name: pool.submit(run, COMMAND_LINES[name]) for name in chosen}
    finally:
        pool.shutdown(cancel_futures=True)


def test_the_console_script_is_installed() -> None:
    assert MINIFAAS.is_file(), f"no {MINIFAAS}: install the project (pip install -e .) to get the minifaas command"


@pytest.mark.parametrize("name", COMMAND_LINES)
def test_runs_under_a_plain_interpreter(name: str, runs: dict[str, Future[subprocess.CompletedProcess[str]]]) -> None:
    done = runs[name].result()
    assert done.returncode == 0, f"{name} under a plain interpreter:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    argv = COMMAND_LINES[name]
    if argv[-1] == "--help":
        assert done.stdout.startswith("usage:"), done.stdout[:500]
    elif "--json" in argv:
        assert json.loads(done.stdout[done.stdout.index("{") :]), done.stdout[-500:]
    elif Path(argv[-1]).stem in WHOLE_EXAMPLES:
        assert EXPECTED[Path(argv[-1]).stem] in done.stdout, done.stdout[-2000:]
