"""Trace readers: Mooncake JSONL and Azure LLM inference CSV, as columns the planner and the simulator share.

Mooncake lines: {"timestamp": ms, "input_length", "output_length", "hash_ids"}, a hash id per
``MOONCAKE_BLOCK_TOKENS`` of prompt (a trace without them has no prefix information). Azure rows: TIMESTAMP,
ContextTokens, GeneratedTokens; no prefix information. Both are UTF-8 text; a file that is not is refused by name.
``length_scale`` multiplies prompt lengths, ``rate_scale`` the arrival rate. A shipped trace goes by name
(``SHIPPED_TRACES``), anything else is a path.
"""

from __future__ import annotations

import contextlib
import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
TRACES_DIR = Path(__file__).resolve().parents[1] / "data" / "traces"
SHIPPED_TRACES = {  # name -> file in TRACES_DIR
    "mooncake-synthetic": "mooncake_synthetic_trace.jsonl",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
}


@dataclass(frozen=True)
class Trace:
    """A trace's requests in arrival order, as columns."""

    name: str
    arrival_s: np.ndarray  # float64, sorted, from 0
    input_tokens: np.ndarray  # int64, >= 1, scaled
    output_tokens: np.ndarray  # int64
    hash_ids: tuple[tuple[int, ...], ...] | None  # one id per block_tokens block; None: no prefix information
    block_tokens: int


def trace_path(name_or_path: str | Path) -> Path:
    """A shipped trace's file, or the path given; FileNotFoundError names the shipped ones."""
    if str(name_or_path) in SHIPPED_TRACES:
        return TRACES_DIR / SHIPPED_TRACES[str(name_or_path)]
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        names = ", ".join(SHIPPED_TRACES)
        raise FileNotFoundError(f"no trace {str(name_or_path)!r}: not a shipped trace ({names}) or a file")
    return path


def read_trace(name_or_path: str | Path, length_scale: float = 1.0, rate_scale: float = 1.0) -> Trace:
    path = trace_path(name_or_path)
    if path.suffix == ".jsonl":
        return read_mooncake(path, length_scale, rate_scale)
    if path.suffix == ".csv":
        return read_azure(path, length_scale, rate_scale)
    raise ValueError(f"{path}: expected a Mooncake .jsonl or an Azure .csv trace")


def read_mooncake(path: str | Path, length_scale: float = 1.0, rate_scale: float = 1.0) -> Trace:
    """A trace whose lines have no ``hash_ids`` carries no prefix information; one with some lines only is refused."""
    times, inputs, outputs, ids = [], [], [], []
    lines_with_ids: dict[bool, int] = {}  # has hash_ids -> the first line that does (or does not)
    with open(path, encoding="utf-8") as f, _text(path):
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            with _row(path, n):
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"not a JSON object: {line.strip()[:40]}")
                times.append(float(row["timestamp"]) / 1000.0)
                inputs.append(int(row["input_length"]))
                outputs.append(int(row["output_length"]))
                ids.append(tuple(int(h) for h in row.get("hash_ids", ())))
                lines_with_ids.setdefault("hash_ids" in row, n)
                need = -(-inputs[-1] // MOONCAKE_BLOCK_TOKENS)
                if "hash_ids" in row and inputs[-1] >= 1 and len(ids[-1]) != need:
                    raise ValueError(f"{inputs[-1]} prompt tokens need {need} hash_ids of {MOONCAKE_BLOCK_TOKENS} "
                                     f"tokens, not {len(ids[-1])}")  # fmt: skip
    if len(lines_with_ids) == 2:
        raise ValueError(f"{path}: line {lines_with_ids[True]} has hash_ids and line {lines_with_ids[False]} has "
                         "none: give every line its ids, or none")  # fmt: skip
    keyed = ids if True in lines_with_ids else None
    return _build(Path(path).name, times, inputs, outputs, keyed, length_scale, rate_scale)


def read_azure(path: str | Path, length_scale: float = 1.0, rate_scale: float = 1.0) -> Trace:
    times, inputs, outputs = [], [], []
    with open(path, newline="", encoding="utf-8") as f, _text(path):
        rows = csv.DictReader(f)
        for row in rows:
            with _row(path, rows.line_num):
                stamp = row["TIMESTAMP"].strip()
                # seven fractional digits: fromisoformat takes at most six
                head, _, frac = stamp.partition(".")
                if frac and not (frac.isascii() and frac.isdigit()):
                    raise ValueError(f"the fraction of a second {frac!r} is not digits")
                when = datetime.fromisoformat(head)
                when = when if when.tzinfo is not None else when.replace(tzinfo=UTC)  # no zone: UTC, not local time
                times.append(when.timestamp() + float(f"0.{frac or 0}"))
                inputs.append(int(row["ContextTokens"]))
                outputs.append(int(row["GeneratedTokens"]))
    return _build(Path(path).name, times, inputs, outputs, None, length_scale, rate_scale)


@contextlib.contextmanager
def _text(path: str | Path) -> Iterator[None]:
    """A file that is not UTF-8 text is an error naming it and the first byte that is not."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x}: {e.reason})") from None


@contextlib.contextmanager
def _row(path: str | Path, line: int) -> Iterator[None]:
    """A row that cannot be read is an error naming the file, the line and what is wrong with it."""
    try:
        yield
    except KeyError as e:
        raise ValueError(f"{path} line {line}: no {e.args[0]!r}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {line}: not JSON ({e.msg} at character {e.pos})") from None
    except (ValueError, TypeError, AttributeError) as e:  # not a number, not a date, not an object
        raise ValueError(f"{path} line {line}: {e}") from None


def _build(
    name: str,
    times: list[float],
    inputs: list[int],
    outputs: list[int],
    ids: list[tuple[int, ...]] | None,
    length_scale: float,
    rate_scale: float,
) -> Trace:
    if length_scale <= 0 or rate_scale <= 0:
        raise ValueError("length_scale and rate_scale must be > 0")
    if not times:
        raise ValueError(f"{name}: no requests in the trace")
    for row, (prompt, output) in enumerate(zip(inputs, outputs, strict=True), start=1):
        if prompt < 1 or output < 1:  # a scaled length rounds up to 1, but a row's own is data
            raise ValueError(f"{name}: request {row} has {prompt} prompt and {output} output tokens; need >= 1 each")
    t = np.asarray(times, dtype=float)
    if not np.isfinite(t).all():
        raise ValueError(f"{name}: request {int(np.argmin(np.isfinite(t))) + 1} has no finite timestamp")
    order = np.argsort(t, kind="stable")
    t = (t[order] - t[order[0]]) / rate_scale if t.size else t
    prompts = np.maximum(1, np.rint(np.asarray(inputs, dtype=float)[order] * length_scale)).astype(np.int64)
    hash_ids = tuple(ids[i] for i in order) if ids is not None else None
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))
    if hash_ids is not None:  # keep ceil(prompt / block) == number of ids after rounding
        n_ids = np.array([len(h) for h in hash_ids])
        prompts = np.clip(prompts, np.maximum(1, (n_ids - 1) * block + 1), np.maximum(1, n_ids * block))
    label = f"{name} (length x{length_scale:g}, rate x{rate_scale:g})"
    return Trace(label, t, prompts, np.asarray(outputs, dtype=np.int64)[order], hash_ids, block)
