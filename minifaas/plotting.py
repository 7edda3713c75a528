"""Figures need matplotlib, the optional ``plot`` extra: a command asks ``matplotlib_missing`` before it draws
and, on an install without it, prints the one line it returns in place of the figure."""

from __future__ import annotations

import importlib.util

INSTALL = "pip install -e '.[plot]'"


def matplotlib_missing(figure: str) -> str | None:
    """None when matplotlib can be imported; else the line to print instead of ``figure``."""
    if importlib.util.find_spec("matplotlib") is not None:
        return None
    return f"no {figure}: matplotlib is not installed ({INSTALL})"
