"""Flag types the subcommands share: each checks a value as it is parsed, so a bad one is argparse's error line.

A type returns the value as the code downstream takes it (a model stays its
name, a rate its text), having made sure it will be understood: a model
resolves, a file exists, a trace is shipped or a file, a rate parses.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from minifaas.transport.pacer import RateSchedule, parse_rate

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def model(text: str) -> str:
    """A preset name, a checkpoint directory or a config.json."""
    from minifaas.model.loader import ModelSpec

    try:
        ModelSpec.resolve(text)
    except FileNotFoundError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def device(text: str) -> str:
    """cpu or cuda[:N], and a CUDA device only where there is one."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu or cuda:N)")
    if text.startswith("cuda"):
        import torch

        index = int(text.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def existing_file(text: str) -> str:
    if not Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def trace(text: str) -> str:
    """A shipped trace's name or a trace file."""
    from minifaas.traces import trace_path

    try:
        trace_path(text)
    except FileNotFoundError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def rate(text: str) -> str:
    """A link rate as ``parse_rate`` reads it: 100mbit, 5gbit, 2.5e8, none."""
    try:
        parsed = parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if parsed is not None and parsed <= 0:
        raise argparse.ArgumentTypeError(f"a rate must be positive, got {text!r}")
    return text


def rate_schedule(text: str) -> str:
    """Rate steps as ``RateSchedule.parse`` reads them: SECONDS:RATE,..."""
    try:
        RateSchedule.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a rate schedule: {text!r} ({e})") from None
    return text


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 1, e.g. 64,256,1024."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r} (e.g. 64,256,1024)") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need integers >= 1, got {text!r}")
    return values


def address(text: str) -> tuple[str, int]:
    """HOST:PORT (or :PORT, on 127.0.0.1)."""
    host, _, port = text.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}")
    return host or "127.0.0.1", int(port)
