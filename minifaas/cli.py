"""The ``minifaas`` command: one entry point, one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``;
it is imported only when its subcommand runs, so ``minifaas plan`` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "kv-size": ("minifaas.model.kv_size_cli", "KV bytes per token and fixed state per layer kind of a model"),
    "serve": ("minifaas.serve.serve_cli", "start the PrfaaS and PD clusters and serve the OpenAI-compatible API"),
    "demo": ("minifaas.serve.demo", "start the default clusters, send a live mix of short and long prompts, stop"),
    "generate": ("minifaas.model.generate_cli", "prefill and decode one prompt in this process, with timings"),
    "plan": ("minifaas.planner.plan_cli", "solve the PrfaaS throughput model: best threshold and P/D split"),
    "sim": ("minifaas.sim.sim_cli", "discrete-event simulation of a PrfaaS deployment with the live policies"),
    "profile": ("minifaas.model.profile_cli", "measure prefill time, state bytes and decode steps; write a profile"),
    "link-emulator": ("minifaas.transport.emulator", "TCP relay imposing an inter-DC link: rate, delay, faults"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="minifaas", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help or the usage error and exits
    name = argv[0]
    args = command_parser(name).parse_args(argv[1:])
    return int(importlib.import_module(COMMANDS[name][0]).run(args) or 0)


def command_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of subcommand ``name`` (imports its module)."""
    module_name, help_text = COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"minifaas {name}", description=help_text)
    importlib.import_module(module_name).add_arguments(parser)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
