"""Flag types the subcommands share: each checks a value as it is parsed, so a bad one is argparse's error line.

A type returns the value as the code downstream takes it. Files a command reads are checked when it reads them
(``main.user_input``), so parsing never depends on what an earlier command wrote.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

from minifaas.emulator.pacer import RateSchedule, check_window, parse_bytes, parse_rate
from minifaas.net.address import parse_address

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _accepted(check: Callable[[str], object], text: str, error: type[Exception]) -> str:
    """``text``, once ``check`` takes it; the ``error`` it raises instead becomes argparse's error line."""
    try:
        check(text)
    except error as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def model(text: str) -> str:
    """A preset, a shipped checkpoint, a checkpoint directory, a config.json or a hub id (found or fetched)."""
    from minifaas.model.loader import ModelSpec  # torch: only once a model is named

    return _accepted(ModelSpec.resolve, text, FileNotFoundError)


def device(text: str) -> str:
    """cpu or cuda[:N] (whether this machine has it is ``present_device``'s to say, when the command runs)."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu or cuda:N)")
    return text


def gpus(text: str) -> tuple[str, ...]:
    """A comma-separated list of distinct CUDA devices: cuda:0,cuda:1."""
    listed = tuple(d.strip() for d in text.split(","))
    if not all(re.fullmatch(r"cuda:\d+", d) for d in listed) or len(set(listed)) < len(listed):
        raise argparse.ArgumentTypeError(f"not a list of distinct GPUs: {text!r} (cuda:0,cuda:1)")
    return listed


DEVICE_FLAGS = (
    "prfaas_device",
    "pd_device",
    "prfaas_devices",
    "pd_devices",
    "gpu_memory_fraction",
    "allow_slow_kernels",
)


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the clusters run: the same flags for ``serve`` and ``demo`` (their dests are ``DEVICE_FLAGS``)."""
    parser.add_argument("--prfaas-device", type=device, help="cpu or cuda:N for the PrfaaS cluster (default: cpu)")
    parser.add_argument("--pd-device", type=device, help="cpu or cuda:N for the PD cluster (default: cpu)")
    parser.add_argument(
        "--prfaas-devices",
        type=gpus,
        metavar="GPUS",
        help="GPUs for the PrfaaS cluster, one worker each (in serve, unless --prfaas-workers says otherwise), "
        "e.g. cuda:0,cuda:1 (default: none, --prfaas-device)",
    )
    parser.add_argument(
        "--pd-devices",
        type=gpus,
        metavar="GPUS",
        help="GPUs for the PD cluster, dealt to its workers in turn, prefill first; one worker each (in serve, "
        "unless --pd-decode-workers says otherwise) (default: none, --pd-device)",
    )
    parser.add_argument(
        "--gpu-memory-fraction",
        type=float,
        metavar="F",
        help="the share of its GPU each worker may take (default: workers that share a GPU split it equally, "
        "one alone has all of it)",
    )
    parser.add_argument(
        "--allow-slow-kernels",
        action="store_true",
        help="let CUDA workers run without flash-linear-attention (the torch reference kernels; by default they "
        "refuse to start)",
    )


def present_device(name: str) -> None:
    """ValueError unless this machine has the device: before a model loads there and fails deep in torch."""
    if name.startswith("cuda"):
        import torch

        index, count = int(name.partition(":")[2] or 0), torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"no device {name}: this machine has {count} CUDA device(s)")


def trace(text: str) -> str:
    """A shipped trace's name or a trace file."""
    from minifaas.traces import trace_path

    return _accepted(trace_path, text, FileNotFoundError)


def rate(text: str) -> str:
    """A link rate as ``parse_rate`` reads it: 100mbit, 5gbit, 2.5e8, none."""
    return _accepted(parse_rate, text, ValueError)


def window(text: str) -> str:
    """A flow window as ``parse_bytes`` reads it: 262144, 256KiB, 4MiB, none; at least one segment."""
    return _accepted(lambda t: check_window(parse_bytes(t)), text, ValueError)


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


def _number(text: str, convert: Callable[[str], float], ok: Callable[[float], bool], need: str) -> float:
    """``text`` as a finite number that ``ok`` takes; else argparse's error line saying what is needed."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if convert is int else 'a number'}: {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"need {need}, got {text!r}")
    return value


def output_file(text: str) -> str:
    """A file to write: its folder must exist, found when the flags are read rather than after the work."""
    folder = Path(text).absolute().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {folder} to write {Path(text).name} in")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: give the file to write")
    return text


FIGURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")  # what matplotlib writes, with its own backends or Pillow
FIGURE_HELP = "a .png, .pdf, .svg or .jpg file"


def figure_file(text: str) -> str:
    """A figure to write (an ``output_file``), in a format its suffix names and matplotlib writes."""
    suffix = Path(text).suffix.lower()
    if suffix[1:] not in FIGURE_FORMATS:
        said = f"{suffix} is not a figure format" if suffix else "no suffix to say the figure's format"
        raise argparse.ArgumentTypeError(f"{text}: {said}: give {FIGURE_HELP}")
    return output_file(text)


def positive(text: str) -> float:
    """A finite number > 0: a duration, a rate, a scale."""
    return _number(text, float, lambda v: v > 0, "a number > 0")


def non_negative(text: str) -> float:
    """A finite number >= 0: a delay, a warm-up."""
    return _number(text, float, lambda v: v >= 0, "a number >= 0")


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    return _number(text, float, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def count(text: str) -> int:
    """An integer >= 0."""
    return int(_number(text, int, lambda v: v >= 0, "an integer >= 0"))


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return int(_number(text, int, lambda v: v >= 1, "an integer >= 1"))


def policy(text: str) -> str:
    """A policy: a built-in name or module:Class (whether it loads is checked when the command runs)."""
    module, colon, name = text.partition(":")
    if colon and not (module and name and name.isidentifier()):
        raise argparse.ArgumentTypeError(f"not a policy: {text!r} (a built-in name, or module:Class)")
    return text


def policy_arg(text: str) -> tuple[str, object]:
    """KEY=VALUE, a policy's keyword argument: VALUE as JSON (2, 0.5, true, "x", [1, 2]), else a string."""
    key, equals, value = text.partition("=")
    if not (equals and key.isidentifier()):
        raise argparse.ArgumentTypeError(f"not KEY=VALUE: {text!r} (e.g. spread=2)")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_kv_arguments(parser: argparse._ActionsContainer) -> None:
    """--kv-bytes-per-token and --kv-fixed-bytes: a case's state sizes replaced, for ``plan`` and ``sim``."""
    parser.add_argument(
        "--kv-bytes-per-token",
        type=non_negative,
        help="replace the model's KV growth, both clusters (default: the case's)",
    )
    parser.add_argument(
        "--kv-fixed-bytes", type=non_negative, help="replace the model's fixed state per request (default: the case's)"
    )


def add_policy_arguments(parser: argparse._ActionsContainer, flag: str, what: str, default: str, builtins: str) -> None:
    """``--FLAG SPEC`` and ``--FLAG-arg KEY=VALUE`` (repeated), as every command takes a policy."""
    parser.add_argument(
        f"--{flag}", type=policy, metavar="SPEC",
        help=f"{what}: a built-in ({builtins}) or module:Class (docs/POLICIES.md) (default: {default})",
    )  # fmt: skip
    parser.add_argument(
        f"--{flag}-arg", type=policy_arg, action="append", metavar="KEY=VALUE",
        help=f"a keyword argument of the --{flag} policy's constructor; repeat for more (default: none)",
    )  # fmt: skip


def host_port(text: str) -> tuple[str, int]:
    """HOST:PORT as ``parse_address`` reads it (an IPv6 host in brackets): a worker's or a gateway's."""
    try:
        return parse_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def advertised(text: str) -> tuple[str, int | None]:
    """HOST or HOST:PORT, an IPv6 host in brackets ([::1]:9000) or bare without a port (::1); no port: None."""
    if text.startswith("[") and text.endswith("]"):
        return text[1:-1], None
    if text.startswith("[") or text.count(":") == 1:
        return host_port(text)
    if not text or text.startswith(":"):
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST or HOST:PORT")
    return text, None


def address(text: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets), or :PORT on 127.0.0.1."""
    try:
        return parse_address(f"127.0.0.1{text}" if text.startswith(":") else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}") from None


def add_model_arguments(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """--model, --dtype and --trust-remote-code, as every command that loads a model takes them.
    ``defaults`` False leaves them None, for a command whose config file may set them."""
    from minifaas.model.loader import DEFAULT_MODEL, DTYPE_CHOICES  # torch: only for a command that loads a model

    parser.add_argument(
        "--model",
        type=model,
        default=DEFAULT_MODEL if defaults else None,
        help=f"a preset, a shipped checkpoint, a checkpoint directory or a hub id org/name (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto" if defaults else None,
        help="the weights' dtype; auto: bfloat16 on CUDA, float32 on CPU (default: auto)",
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="let a checkpoint's own Python code (auto_map) run"
    )
