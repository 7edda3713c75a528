"""Progress for a long run: each test that took a while says so on its own line, with the time so far.

``pytest -q`` prints a dot per test, and a module of served tests can hold the
line for minutes; these lines show what ran and how the run is going.
"""

from __future__ import annotations

import time

import pytest

NOTE_AFTER_S = 15.0  # a test (setup, call and teardown together) longer than this gets a line


class Progress:
    def __init__(self, reporter: object) -> None:
        self.reporter = reporter
        self.started = time.monotonic()
        self.spent: dict[str, float] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        spent = self.spent[report.nodeid] = self.spent.get(report.nodeid, 0.0) + report.duration
        if report.when == "teardown" and spent >= NOTE_AFTER_S:
            minutes = (time.monotonic() - self.started) / 60
            self.reporter.write_line(f"  [{minutes:5.1f} min] {spent:5.1f} s  {report.nodeid}")  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        config.pluginmanager.register(Progress(reporter), "minifaas-progress")
