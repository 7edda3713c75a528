"""docs/READING.md lists exactly the package files one long prompt and one short prompt run.

``benchmarks/request_path.py`` serves the two requests under coverage in every process of ``minifaas serve`` and
keeps the lines each ran that the idle server did not; the files holding them (the link emulator apart) are the
reading list's first part. A file the requests run that the list misses fails here, and so does a listed file
they never run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import request_path  # benchmarks/, on the path through conftest.py

ROOT = Path(__file__).resolve().parent.parent
READING = ROOT / "docs" / "READING.md"
REST = "## The rest of the package"


def listed(text: str) -> list[str]:
    """The files the list names before its part on the rest of the package, in its order."""
    head = text.split(REST)[0]
    return list(dict.fromkeys(re.findall(r"`(minifaas/[\w/]+\.py)`", head)))


@pytest.fixture(scope="module")
def ran() -> dict[str, dict[str, set[int]]]:
    return request_path.measure(idle_s=10.0)


@pytest.mark.slow
def test_the_reading_list_is_the_files_the_two_requests_run(ran: dict[str, dict[str, set[int]]]) -> None:
    run = set(request_path.core(ran["long"])) | set(request_path.core(ran["short"]))
    names = set(listed(READING.read_text()))
    assert sorted(run - names) == [], "files the requests run that docs/READING.md does not list"
    assert sorted(names - run) == [], "files docs/READING.md lists that neither request runs"


@pytest.mark.slow
def test_the_long_prompt_crosses_the_link_and_the_short_one_does_not(ran: dict[str, dict[str, set[int]]]) -> None:
    assert any(f.startswith("minifaas/emulator/") for f in ran["long"])
    assert not any(f.startswith("minifaas/emulator/") for f in ran["short"])


def test_a_branch_of_code_that_also_runs_while_idle_is_not_the_requests() -> None:
    heartbeat = ROOT / "minifaas" / "control" / "heartbeat.py"
    source = heartbeat.read_text().splitlines()
    start = next(i for i, line in enumerate(source, 1) if "def deadline_left" in line)
    quiet, late = {start + 1, start + 2}, {start + 1, start + 3}  # no ping outstanding; one outstanding
    assert request_path.own_lines(heartbeat, late, quiet) == set()  # a load-dependent branch of the watchdog
    ping_due = next(i for i, line in enumerate(source, 1) if "def ping_due" in line)
    assert request_path.own_lines(heartbeat, late | {ping_due + 1}, quiet) == {start + 3, ping_due + 1}


def test_the_list_is_read_up_to_the_rest_of_the_package() -> None:
    text = f"1. `minifaas/a.py`: x\n2. `minifaas/b/c.py` and `minifaas/a.py`\n{REST}\n- `minifaas/d.py`\n"
    assert listed(text) == ["minifaas/a.py", "minifaas/b/c.py"]
