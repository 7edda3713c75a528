"""Figures need matplotlib, the optional ``plot`` extra: a command draws through ``draw_or_say``, which on an
install without it prints one line in place of the figure."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

INSTALL = "pip install -e '.[plot]'"


def draw_or_say(png: str, draw: Callable[[str], object]) -> bool:
    """``draw(png)`` when matplotlib can be imported; else the line saying why not, on stderr. True if drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"no plot {png}: matplotlib is not installed ({INSTALL})", file=sys.stderr)
        return False
    draw(png)
    return True
