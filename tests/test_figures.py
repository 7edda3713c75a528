"""JSON figures: six significant digits through nested containers; NaN and infinities left as they are."""

from __future__ import annotations

import json
import math

from minifaas.figures import dumps, rounded


def test_floats_are_cut_to_six_significant_digits_at_any_depth() -> None:
    value = {"a": 1 / 3, "b": [2 / 3, (123456789.0, 7)], "c": {"d": 1.2345678e-9}, "e": "text", "f": True}
    assert rounded(value) == {
        "a": 0.333333,
        "b": [0.666667, [123457000.0, 7]],
        "c": {"d": 1.23457e-9},
        "e": "text",
        "f": True,
    }
    assert json.loads(dumps({"x": 0.1 + 0.2})) == {"x": 0.3}


def test_nan_and_infinity_are_not_hidden() -> None:
    assert math.isnan(rounded(float("nan"))) and rounded(float("inf")) == float("inf")
    assert dumps([float("nan")]) == "[NaN]"  # a benchmark's check for NaN still sees it
