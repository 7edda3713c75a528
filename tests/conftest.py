"""Shared test plumbing: progress lines for a long run, two module-scoped fixtures and a gateway helper.

``pytest -q`` prints a dot per test, and a module of served tests can hold the
line for minutes; each test that took a while says so on its own line, with
the run's time so far.

    loop               one event loop for a module whose fixtures keep a gateway up across tests
    one_torch_thread   torch on one thread for the module (``pytest.mark.usefixtures``): small
                       forwards on shared, busy cores run several times faster on one thread than two
    served(loop, config)  a module fixture's gateway: ``yield from served(loop, CONFIG)``
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch

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


def served(loop: asyncio.AbstractEventLoop, config: object) -> Iterator[object]:
    """A module's gateway on its ``loop``, up for the module's tests (yield from it in a module fixture)."""
    from minifaas.serve.gateway import Gateway  # only the served modules pay for its imports

    gw = Gateway(config)  # type: ignore[arg-type]
    loop.run_until_complete(gw.__aenter__())
    yield gw
    loop.run_until_complete(gw.__aexit__(None, None, None))


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
