"""Shared test plumbing: one torch thread, progress lines for a long run, the longest files first, fixtures.

``pytest -q`` prints a dot per test, and a module of served tests can hold the
line for minutes; each test that took a while says so on its own line, with
the run's time so far.

Torch runs on one thread in the test process and, by ``OMP_NUM_THREADS=1``, in
every process it starts that does not choose its own count: their forwards are
small, and the two test processes and their children share the same cores (a
second thread per process only spins against them: a CPU dry run of the device
check took three times as long with two).

    loop               one event loop for a module whose fixtures keep a gateway up across tests
    served(loop, config)  a module fixture's gateway: ``yield from served(loop, CONFIG)``
    python             ``python ARGV`` commands forked from one pre-loaded interpreter (tests/preloaded.py)
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# the network-namespace test hosts (netns.py) live beside the benchmarks that also use them
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

# a test (setup, call and teardown together) longer than this gets a line
NOTE_AFTER_S = float(os.environ.get("MINIFAAS_NOTE_AFTER_S", "15"))
# the files that take longest on two cores (a minute or more each): they start first, so that no worker
# is left running one alone at the end while the other has nothing to do. Under ``-n 2 --dist loadfile``
# xdist hands out files in the order collected here (pytest_configure turns its own order, most tests
# first, off: that one sends these, which hold one or two tests each, last). The first runs two commands
# at a time for minutes; the next four spend much of their time waiting on links, deadlines and emulated
# load, so the other worker runs them beside it and fills the cores they leave idle.
LONGEST_FIRST = (
    "test_benchmarks_run.py", "test_deploy.py", "test_chaos.py", "test_two_hosts.py", "test_scheduler_live.py",
    "test_docs_run.py", "test_runtime.py", "test_gpu_check.py",
)  # fmt: skip


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


# under CI a skip must be one of these (no GPU there); any other (no root, no openssl, no namespaces, a missing
# extra) fails the run, so a machine that lacks something cannot pass by skipping what needs it
ALLOWED_SKIPS_IN_CI = ("needs a CUDA device", "a CUDA device is here", "needs a GPU")


class SkipGuard:
    """Under ``CI``, a run whose skips include one outside ``ALLOWED_SKIPS_IN_CI`` fails, naming each."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
            if not any(allowed in reason for allowed in ALLOWED_SKIPS_IN_CI):
                self.refused.append(f"{report.nodeid}: {reason}")

    def pytest_terminal_summary(self, terminalreporter: object) -> None:
        for line in self.refused:
            terminalreporter.write_line(f"SKIP NOT ALLOWED IN CI {line}")  # type: ignore[attr-defined]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.refused and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered, in its own pytest_configure
def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the processes the tests start: commands, benchmarks, children
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        config.pluginmanager.register(Progress(reporter), "minifaas-progress")
    if os.environ.get("CI") and not hasattr(config, "workerinput"):  # the xdist controller sees every report
        config.pluginmanager.register(SkipGuard(), "minifaas-skip-guard")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every file's own tests keep their order


def served(loop: asyncio.AbstractEventLoop, config: object) -> Iterator[object]:
    """A module's gateway on its ``loop``, up for the module's tests (yield from it in a module fixture)."""
    from minifaas.gateway.gateway import Gateway  # only the served modules pay for its imports

    gw = Gateway(config)  # type: ignore[arg-type]
    loop.run_until_complete(gw.__aenter__())
    yield gw
    loop.run_until_complete(gw.__aexit__(None, None, None))


def decodes_as_alone(runtime: Any, tokens: list[int], reply: Any, state: Any, params: Any) -> None:
    """A state that crossed a socket is what one forward of ``tokens`` gives, layer by layer, and decoding it
    after ``reply``'s first token gives transformers' own tokens."""
    from minifaas.model.interleaved_decoder import DecodeStream
    from minifaas.model.reference import reference_tokens

    alone = runtime.prefill(tokens).state
    for got, ref in zip(state.layers, alone.layers, strict=True):
        for (name, x), (_, y) in zip(got.slots, ref.slots, strict=True):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-5), f"layer {got.layer} {name}"
    decoded = DecodeStream(runtime, state, reply.next_token, params).run()
    assert decoded == reference_tokens(runtime, tokens, params)


@pytest.fixture(scope="session")
def python() -> Iterator[object]:
    """The documented commands, benchmarks and examples run through this: each is still a process of its
    own, but the seconds of torch imports are paid once per test process, not once per command."""
    from preloaded import Preloaded

    with Preloaded() as preloaded:
        yield preloaded


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
