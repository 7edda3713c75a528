"""The ``minifaas`` command: one entry point, one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``, and is imported only when its
subcommand runs. Bad input ends in one error line and exit code 2, as argparse ends a usage error; anything else
keeps its traceback.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import signal
import socket
import sys
from collections.abc import Iterator
from typing import NoReturn

from rich.console import Console

import minifaas
from minifaas.proctitle import set_title

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "kv-size": ("minifaas.commands.kv_size_report", "KV bytes per token and fixed state per layer kind of a model"),
    "serve": ("minifaas.commands.serve", "start the PrfaaS and PD clusters and serve the OpenAI-compatible API"),
    "worker": ("minifaas.commands.worker", "one prefill or decode worker, on any host, waiting for a gateway"),
    "demo": ("minifaas.commands.demo", "start the default clusters, send a live mix of short and long prompts, stop"),
    "generate": ("minifaas.commands.generate", "prefill and decode one prompt in this process, with timings"),
    "plan": ("minifaas.commands.plan", "solve the PrfaaS throughput model: best threshold and P/D split"),
    "sim": ("minifaas.commands.sim", "discrete-event simulation of a PrfaaS deployment with the live policies"),
    "profile": (
        "minifaas.commands.profile_model",
        "measure prefill time, state bytes and decode steps; write a profile",
    ),
    "train": ("minifaas.commands.train", "train a tiny hybrid checkpoint from a text file on the CPU"),
    "link-emulator": (
        "minifaas.commands.link_emulator",
        "TCP relay imposing an inter-DC link: rate, delay, window, faults",
    ),
}


class BadInput(Exception):
    """Input the user can correct: printed as one error line, exit code 2."""


@contextlib.contextmanager
def user_input() -> Iterator[None]:
    """Around reading what the user gave (flag values, the files they name): its errors become BadInput."""
    try:
        yield
    except KeyError as e:  # a table or setting missing from a file
        raise BadInput(f"missing setting {e.args[0]!r}") from None
    except OSError as e:
        raise BadInput(f"{e.filename}: {e.strerror}" if e.filename else str(e)) from None
    except (ValueError, TypeError) as e:  # includes TOML and JSON syntax errors, and a setting of the wrong type
        raise BadInput(str(e)) from None


def check_listen(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go, so that a port taken is one error line before slow start-up."""
    try:
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as e:
        raise BadInput(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def exit_at_once(code: int) -> NoReturn:
    """End a finished command without tearing down its modules, which is slow with torch loaded and of no use.
    atexit handlers still run, and both streams are flushed."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


PIPE_WIDTH = 240  # columns of rich output into a file or a pipe, where rich would wrap at 80


def stdout_console() -> Console:
    """Rich output on stdout; into a file or a pipe, a table's lines as long as it needs."""
    return Console() if sys.stdout.isatty() else Console(width=PIPE_WIDTH)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in its help, unless the help says it already or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """A usage error is one line rather than the whole usage, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the process's own command: ``ps`` shows ``minifaas serve --port 8000``, not the interpreter
        set_title(*sys.argv[1:])
    argv = sys.argv[1:] if argv is None else argv
    parser = CommandParser(
        prog="minifaas", description=minifaas.__doc__, epilog="minifaas COMMAND --help: its flags and their defaults."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help or the usage error and exits
    name = argv[0]
    try:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # ^C in torch's import may be lost in C
        try:
            command = command_parser(name)  # imports torch: a ^C meanwhile comes once it is done
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        args = command.parse_args(argv[1:])
        try:
            return int(importlib.import_module(COMMANDS[name][0]).run(args) or 0)
        except BadInput as e:
            command.error(str(e))
    except KeyboardInterrupt:  # ^C in a command that does not stop on it itself (sim, profile, plan): one line
        print(f"minifaas {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout stopped early (``| head``): nothing more to say, to anyone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail again
        return 128 + signal.SIGPIPE


def command_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of subcommand ``name`` (imports its module)."""
    module_name, help_text = COMMANDS[name]
    parser = CommandParser(prog=f"minifaas {name}", description=help_text, formatter_class=HelpFormatter)
    importlib.import_module(module_name).add_arguments(parser)
    return parser


if __name__ == "__main__":  # python -m minifaas.commands.main: this module is __main__, and its BadInput is not the one
    from minifaas.commands.main import main as package_main  # the subcommands raise, so run the package's main

    raise SystemExit(package_main())
