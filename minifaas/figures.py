"""Figures as JSON: every float to six significant digits, so ``--json`` prints what was measured, not float noise.

NaN and infinities stay what they are; "nothing measured" is None (JSON null).
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
    return json.dumps(rounded(value), **kwargs)
