"""Instance profiles: what one instance (``gpus_per_instance`` GPUs serving one replica) costs to prefill or decode.

A file holds a [prefill] and a [decode] table, TOML or JSON (``load_profiles``; ``save_profiles`` writes JSON):

    [prefill]                     # also name = "H20x8" and gpus_per_instance = 8, as in [decode]
    points = [[1024, 0.44, 200068300], [8192, 0.72, 323905126]]   # [tokens, seconds, kv bytes]
    latency_coeffs = [0.389, 4.107e-5, 9.48e-11]                    # seconds = sum c_i * l**i
    kv_fixed_bytes = 180355072                                      # kv bytes = fixed + per_token * l
    kv_bytes_per_token = 17137
    [decode]
    bs_max = 20                   # the largest batch meeting the decode SLO
    step_time_s = 0.025           # one decode step at bs_max
    steps = [[1, 0.012], [8, 0.016], [32, 0.03]]   # optional: [batch, seconds] of every batch measured
    context = 64                  # optional: the tokens each row held as they were measured,
    slot_s = 1.3e-7               #   and what a step adds per row for each token of the batch's width past it
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    tokens: int
    latency_s: float
    kv_bytes: float

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.latency_s <= 0 or self.kv_bytes < 0:
            raise ValueError(f"bad profile point {self}")


@dataclass(frozen=True, slots=True)
class PrefillProfile:
    """Latency: the polynomial ``latency_coeffs`` when given, else ``points`` interpolated piecewise-linearly
    (extrapolated linearly past either end); KV bytes: the linear form when ``kv_bytes_per_token`` is given,
    else the same interpolation. ``fit_latency`` and ``fit_kv`` fit both forms to measured points."""

    name: str
    gpus_per_instance: int
    points: tuple[ProfilePoint, ...] = ()
    latency_coeffs: tuple[float, ...] = ()
    kv_fixed_bytes: float = 0.0
    kv_bytes_per_token: float | None = None  # None: the points' KV bytes, interpolated

    def __post_init__(self) -> None:
        if self.gpus_per_instance < 1:
            raise ValueError(f"{self.name}: gpus_per_instance must be >= 1")
        lengths = [p.tokens for p in self.points]
        if lengths != sorted(set(lengths)):
            raise ValueError(f"{self.name}: points must have strictly increasing lengths")
        if not self.latency_coeffs and len(self.points) < 2:
            raise ValueError(f"{self.name}: give latency_coeffs or at least two points")
        if self.kv_bytes_per_token is None and len(self.points) < 2:
            raise ValueError(f"{self.name}: give kv_bytes_per_token or at least two points")
        if self.kv_fixed_bytes < 0 or (self.kv_bytes_per_token or 0.0) < 0:
            raise ValueError(f"{self.name}: KV sizes must be >= 0")
        probe = np.array([1.0, 1e3, 1e4, 1e5, 1e6])
        if np.any(self.latency_s(probe) <= 0):
            raise ValueError(f"{self.name}: prefill latency must stay positive")

    def latency_s(self, tokens: np.ndarray | float) -> np.ndarray:
        """T_prefill(l): seconds for one instance to prefill ``tokens`` uncached tokens."""
        x = np.asarray(tokens, dtype=float)
        if self.latency_coeffs:
            return np.polynomial.polynomial.polyval(x, self.latency_coeffs)
        return _interpolate(x, [p.tokens for p in self.points], [p.latency_s for p in self.points])

    def slowed(self, factor: float) -> PrefillProfile:
        """The same profile with every prefill ``factor`` times as long."""
        points = tuple(ProfilePoint(p.tokens, p.latency_s * factor, p.kv_bytes) for p in self.points)
        return replace(self, points=points, latency_coeffs=tuple(c * factor for c in self.latency_coeffs))

    def kv_bytes(self, tokens: np.ndarray | float) -> np.ndarray:
        """S_kv(l): bytes of state a prefill of ``tokens`` produces (fixed state plus growing KV)."""
        x = np.asarray(tokens, dtype=float)
        if self.kv_bytes_per_token is not None:
            return self.kv_fixed_bytes + self.kv_bytes_per_token * x
        return _interpolate(x, [p.tokens for p in self.points], [p.kv_bytes for p in self.points])


@dataclass(frozen=True, slots=True)
class DecodeProfile:
    name: str
    gpus_per_instance: int
    bs_max: int
    step_time_s: float  # one decode step at bs_max: measured, or at most the SLO's time per output token
    steps: tuple[tuple[int, float], ...] = ()  # (batch, step seconds) of every batch measured, if kept
    context: int = 0  # the tokens each row held as the steps were measured
    slot_s: float = 0.0  # seconds a step adds per row for each token slot of the batch's width past ``context``

    def __post_init__(self) -> None:
        if self.gpus_per_instance < 1 or self.bs_max < 1 or self.step_time_s <= 0:
            raise ValueError(f"{self.name}: need gpus_per_instance >= 1, bs_max >= 1, step_time_s > 0")
        if self.context < 0 or self.slot_s < 0:
            raise ValueError(f"{self.name}: need context >= 0 and slot_s >= 0")
        batches = [b for b, _ in self.steps]
        if batches != sorted(set(batches)) or any(b < 1 or s <= 0 for b, s in self.steps):
            raise ValueError(f"{self.name}: steps must be (batch >= 1, seconds > 0) by increasing batch")

    def step_s(self, batch: int, width: int = 0) -> float:
        """One step's seconds with ``batch`` rows: the measured steps interpolated, the smallest batch's below
        them, extended linearly above; ``step_time_s`` for every batch when no steps were kept. Plus, rows being
        padded to the longest, ``slot_s`` per row for each token of ``width`` past ``context``."""
        padded = self.slot_s * batch * max(0, width - self.context)
        if not self.steps:
            return self.step_time_s + padded
        xs, ys = [b for b, _ in self.steps], [s for _, s in self.steps]
        if len(xs) == 1 or batch <= xs[-1]:
            return float(np.interp(batch, xs, ys)) + padded
        return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (batch - xs[-1]) + padded

    def requests_per_s(self, output_tokens: float) -> float:
        """One instance's decode throughput, eq 5 per instance: BS_max / (T_decode * L_out)."""
        return self.bs_max / (self.step_time_s * output_tokens)

    @classmethod
    def from_steps(
        cls, name: str, gpus_per_instance: int, steps: list[tuple[int, float]], slo_tokens_per_s: float
    ) -> DecodeProfile:
        """From measured (batch size, step seconds): BS_max is the largest batch whose step still meets
        the per-token SLO, and its measured step is the step time (a batch decodes as fast as it can)."""
        slo_step = 1.0 / slo_tokens_per_s
        fitting = [(batch, seconds) for batch, seconds in steps if seconds <= slo_step]
        if not fitting:
            raise ValueError(f"{name}: no measured batch meets {slo_tokens_per_s:g} tokens/s")
        return cls(name, gpus_per_instance, *max(fitting), steps=tuple(sorted(steps)))


def fit_latency(points: tuple[ProfilePoint, ...], degree: int = 2) -> tuple[float, ...]:
    """Least-squares polynomial (lowest order first) through measured prefill latencies."""
    if len(points) <= degree:
        raise ValueError(f"need more than {degree} points to fit degree {degree}")
    x = np.array([p.tokens for p in points], dtype=float)
    y = np.array([p.latency_s for p in points])
    return tuple(float(c) for c in np.polynomial.polynomial.polyfit(x, y, degree))


def fit_kv(points: tuple[ProfilePoint, ...]) -> tuple[float, float]:
    """Least-squares (fixed bytes, bytes per token) through measured KV sizes."""
    if len(points) < 2:
        raise ValueError("need at least two points to fit KV bytes")
    x = np.array([p.tokens for p in points], dtype=float)
    fixed, per_token = np.polynomial.polynomial.polyfit(x, np.array([p.kv_bytes for p in points]), 1)
    return float(fixed), float(per_token)


def _interpolate(x: np.ndarray, xs: list[int], ys: list[float]) -> np.ndarray:
    inside = np.interp(x, xs, ys)
    lo_slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
    hi_slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    below = ys[0] + lo_slope * (x - xs[0])
    above = ys[-1] + hi_slope * (x - xs[-1])
    return np.where(x < xs[0], below, np.where(x > xs[-1], above, inside))


def _rows(name: str, data: dict[str, Any], key: str, columns: dict[str, type]) -> list[tuple[Any, ...]]:
    """The ``key`` list of ``data`` (none: empty), each row converted column by column; ValueError naming the
    profile and the key if it is not a list of rows of ``columns`` (name -> type)."""
    rows = data.get(key, [])
    try:
        if not isinstance(rows, list | tuple) or not all(isinstance(row, list | tuple) for row in rows):
            raise TypeError
        return [tuple(kind(x) for kind, x in zip(columns.values(), row, strict=True)) for row in rows]
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {key} must be a list of [{', '.join(columns)}], got {rows!r}") from None


def prefill_from_dict(data: dict[str, Any]) -> PrefillProfile:
    name = str(data["name"])
    rows = _rows(name, data, "points", {"tokens": int, "seconds": float, "kv_bytes": float})
    points = tuple(ProfilePoint(*row) for row in rows)
    return PrefillProfile(
        name=name,
        gpus_per_instance=int(data["gpus_per_instance"]),
        points=points,
        latency_coeffs=tuple(float(c) for c in data.get("latency_coeffs", ())),
        kv_fixed_bytes=float(data.get("kv_fixed_bytes", 0.0)),
        kv_bytes_per_token=None if data.get("kv_bytes_per_token") is None else float(data["kv_bytes_per_token"]),
    )


def decode_from_dict(data: dict[str, Any]) -> DecodeProfile:
    name = str(data["name"])
    return DecodeProfile(
        name=name,
        gpus_per_instance=int(data["gpus_per_instance"]),
        bs_max=int(data["bs_max"]),
        step_time_s=float(data["step_time_s"]),
        steps=tuple(_rows(name, data, "steps", {"batch": int, "seconds": float})),
        context=int(data.get("context", 0)),
        slot_s=float(data.get("slot_s", 0.0)),
    )


def checked_table(path: str | Path, table: str, value: object, known: tuple[str, ...]) -> None:
    """ValueError naming the file and the setting unless ``value`` is a table of ``known`` settings only, every
    number in it finite."""
    if not isinstance(value, dict):
        raise ValueError(f"{path}: [{table}] must be a table, got {value!r}")
    if unknown := sorted(set(value) - set(known)):
        raise ValueError(f"{path}: [{table}] unknown settings {unknown} (known: {', '.join(known)})")
    for name, item in value.items():
        check_finite(path, f"[{table}] {name}", item)


def check_finite(path: str | Path, setting: str, value: object) -> None:
    """ValueError naming ``setting`` if ``value`` is, or a list in it holds, a NaN or an infinity (as a number,
    or as text that would be read as one); names and traces are text and not checked."""
    if setting.rpartition(" ")[2] in ("name", "trace"):
        return
    if any(not math.isfinite(_number(v)) for v in _items(value)):
        need = "finite numbers" if isinstance(value, list) else "a finite number"
        raise ValueError(f"{path}: {setting} must be {need}, got {value!r}")


def _number(value: object) -> float:
    """``value`` read as a number; 0 for one that cannot be read (refused where it is read)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:  # an integer past every float
        return math.inf
    except (TypeError, ValueError):
        return 0.0


def _items(value: object) -> list[object]:
    """A setting's value, or the values in its lists, lists of lists included (a profile's points)."""
    return [x for v in value for x in _items(v)] if isinstance(value, list) else [value]


def load_table(path: str | Path, what: str, shape: str) -> dict[str, Any]:
    """A TOML or JSON file (chosen by suffix) as a dict; ValueError naming the file as not a ``what`` unless it
    reads as a table (``shape`` says of what)."""
    read = json.loads if Path(path).suffix == ".json" else tomllib.loads
    try:
        data = read(Path(path).read_text())
    except ValueError as e:  # JSON's and TOML's syntax errors
        raise ValueError(f"{path}: not a {what} ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a {what} ({shape})")
    return data


def load_profiles(path: str | Path) -> tuple[PrefillProfile | None, DecodeProfile | None]:
    """The ``[prefill]`` and ``[decode]`` tables of one profile file (either may be absent); a file or table that
    cannot be read is a ValueError naming the file and the table."""
    data = load_table(path, "profile", "a table of [prefill] and [decode]")
    readers = {"prefill": (prefill_from_dict, PrefillProfile), "decode": (decode_from_dict, DecodeProfile)}
    if unknown := sorted(set(data) - set(readers)):
        raise ValueError(f"{path}: unknown tables {unknown} (known: prefill, decode)")
    tables: list[Any] = []
    for name, (read, kind) in readers.items():
        if name in data:
            checked_table(path, name, data[name], tuple(f.name for f in fields(kind)))
        try:
            tables.append(read(data[name]) if name in data else None)
        except KeyError as e:
            raise ValueError(f"{path}: [{name}] has no {e.args[0]!r}") from None
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: [{name}]: {e}") from None
    return tables[0], tables[1]


def load_prefill_profile(path: str | Path) -> PrefillProfile:
    """The ``[prefill]`` table of a profile file; ValueError if it has none."""
    prefill, _ = load_profiles(path)
    if prefill is None:
        raise ValueError(f"{path}: no [prefill] table")
    return prefill


def load_pd_profiles(path: str | Path) -> tuple[PrefillProfile, DecodeProfile]:
    """Both tables of a PD instance's profile file; ValueError if either is missing."""
    prefill, decode = load_profiles(path)
    if prefill is None or decode is None:
        raise ValueError(f"{path}: a profile needs [prefill] and [decode] tables (minifaas profile)")
    return prefill, decode


def profile_tables(prefill: PrefillProfile | None = None, decode: DecodeProfile | None = None) -> dict[str, Any]:
    """The ``[prefill]`` and ``[decode]`` tables of the profiles given, as ``load_profiles`` reads them."""
    data: dict[str, Any] = {}
    if prefill is not None:
        table = asdict(prefill)
        table["points"] = [[p.tokens, p.latency_s, p.kv_bytes] for p in prefill.points]
        data["prefill"] = table
    if decode is not None:
        data["decode"] = asdict(decode)
    return data


def save_profiles(path: str | Path, prefill: PrefillProfile | None = None, decode: DecodeProfile | None = None) -> None:
    """Write one profile file (JSON) that ``load_profiles`` reads back unchanged."""
    Path(path).write_text(json.dumps(profile_tables(prefill, decode), indent=2) + "\n")
