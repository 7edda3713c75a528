"""Start-up progress: each worker and link emulator the gateway starts, starting and then ready.

``reported`` tells a ``StartupListener`` (or the log) as a process starts and when it is ready or has failed;
``StartupView`` shows the reports as a live table on a terminal, or one line per report elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum
from types import TracebackType
from typing import TypeVar

from rich.console import Console
from rich.live import Live
from rich.table import Table

log = logging.getLogger("minifaas.gateway")
T = TypeVar("T")


class Stage(StrEnum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"


StartupListener = Callable[[str, str, Stage], None]  # (name, what it is, stage)


def describe(name: str, what: str, stage: Stage, took: float | None) -> str:
    """One report as a line: ``pd-d0 (pd decode worker) ready after 4.2 s``."""
    return f"{name} ({what}) {stage}" + ("" if took is None else f" after {took:.1f} s")


async def reported(listener: StartupListener | None, name: str, what: str, start: Awaitable[T]) -> T:
    """Await a process's start, and tell ``listener`` that it began and how it ended (no listener: the log)."""

    def report(stage: Stage, took: float | None) -> None:
        if listener is not None:
            listener(name, what, stage)
        else:
            log.info("%s", describe(name, what, stage, took))

    began = time.perf_counter()
    report(Stage.STARTING, None)
    try:
        started = await start
    except BaseException:
        report(Stage.FAILED, time.perf_counter() - began)
        raise
    report(Stage.READY, time.perf_counter() - began)
    return started


class StartupView:
    """A ``StartupListener`` for a command's output. ``console`` on a terminal: the live table there;
    otherwise each report goes to ``line`` as one line of text."""

    def __init__(self, console: Console, line: Callable[[str], None]) -> None:
        self.console, self.line = console, line
        self.rows: dict[str, tuple[str, Stage, float, float | None]] = {}  # name -> what, stage, began, took
        self._live: Live | None = None

    def __enter__(self) -> StartupView:
        if self.console.is_terminal:
            self._live = Live(console=self.console, refresh_per_second=4, get_renderable=self._table)
            self._live.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.__exit__(kind, error, tb)  # the table stays, as it ended
            self._live = None

    def __call__(self, name: str, what: str, stage: Stage) -> None:
        now = time.perf_counter()
        began = self.rows[name][2] if name in self.rows else now
        took = None if stage is Stage.STARTING else now - began
        self.rows[name] = (what, stage, began, took)
        if self._live is not None:
            self._live.refresh()
        else:
            self.line(describe(name, what, stage, took))

    def _table(self) -> Table:
        table = Table(title="starting the clusters", title_justify="left")
        for column in ("process", "what", "state", "s"):
            table.add_column(column, justify="right" if column == "s" else "left")
        now = time.perf_counter()
        for name, (what, stage, began, took) in list(self.rows.items()):  # the refresh thread reads it too
            style = {Stage.STARTING: "yellow", Stage.READY: "green", Stage.FAILED: "red"}[stage]
            seconds = took if took is not None else now - began
            table.add_row(name, what, f"[{style}]{stage}[/]", f"{seconds:.1f}")
        return table
