"""Figures as JSON: every float to six significant digits, so ``--json`` prints what was measured, not float noise.

Six digits keep more than any figure here is worth (timings on shared cores
vary in the second digit; the planner's outputs are exact for their inputs to
about that) and make a figure read the same in a table and in JSON. NaN and
infinities stay what they are: a caller that means "nothing measured" says so
with None (JSON null).
"""

from __future__ import annotations

import json
import math
from typing import Any

SIGNIFICANT_DIGITS = 6


def rounded(value: Any, digits: int = SIGNIFICANT_DIGITS) -> Any:
    """``value`` with every finite float in it (through dicts, lists and tuples) cut to ``digits`` significant."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``rounded(value)``."""
    return json.dumps(rounded(value), **kwargs)
