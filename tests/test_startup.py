"""The start-up view: a live table on a terminal, one line per report elsewhere."""

from __future__ import annotations

import io

from rich.console import Console

from minifaas.launch.startup import Stage, StartupView, describe


def test_into_a_file_each_report_is_one_line() -> None:
    lines: list[str] = []
    console = Console(file=io.StringIO())
    with StartupView(console, lines.append) as view:
        view("pd-d0", "pd decode worker", Stage.STARTING)
        view("pd-d0", "pd decode worker", Stage.READY)
        view("prfaas->pd", "link emulator, 50mbit", Stage.FAILED)
    assert lines[0] == "pd-d0 (pd decode worker) starting"
    assert lines[1].startswith("pd-d0 (pd decode worker) ready after ") and lines[1].endswith(" s")
    assert lines[2].startswith("prfaas->pd (link emulator, 50mbit) failed after ")
    assert console.file.getvalue() == ""  # type: ignore[attr-defined]


def test_on_a_terminal_one_table_shows_every_process_as_it_ended() -> None:
    lines: list[str] = []
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    with StartupView(console, lines.append) as view:
        view("prfaas-p0", "prfaas prefill worker", Stage.STARTING)
        view("pd-d0", "pd decode worker", Stage.STARTING)
        view("prfaas-p0", "prfaas prefill worker", Stage.READY)
    screen = console.file.getvalue()  # type: ignore[attr-defined]
    assert lines == [] and "starting the clusters" in screen
    last = screen[screen.rindex("starting the clusters") :]
    assert "prfaas-p0" in last and "ready" in last and "pd-d0" in last and "starting" in last


def test_a_report_reads_the_same_in_the_log() -> None:
    assert describe("pd-p0", "pd prefill worker", Stage.READY, 4.25) == "pd-p0 (pd prefill worker) ready after 4.2 s"
    assert describe("pd-p0", "pd prefill worker", Stage.STARTING, None) == "pd-p0 (pd prefill worker) starting"
