"""``minifaas sim compare``: the same deployment and workload simulated once per ``--policy``, side by side.

    minifaas sim compare --policy default --policy mymodule:MyRouter --trace mooncake-synthetic

A ``--policy`` is ``[KIND=]SPEC[,KEY=VALUE...]``; every other flag is ``minifaas sim``'s and holds for every
policy alike. Prints a table and writes the plot; with ``--json`` stdout holds one JSON object of every policy's
figures alone, and the table and notes go to stderr. Each policy may be given once.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from minifaas import figures
from minifaas.commands import arguments
from minifaas.commands.main import PIPE_WIDTH, stdout_console
from minifaas.plotting import draw_or_say
from minifaas.sim.comparison import COLUMNS, cells, compare, plot_comparison
from minifaas.sim.deployment import SimConfig
from minifaas.sim.report import SimResult
from minifaas.sim.workload import Workload

# a policy's flag (and --policy KIND) -> the SimConfig fields of its spec and of its arguments
POLICY_FIELDS = {
    "router": ("router_policy", "router_args"),
    "short-term": ("short_term_policy", "short_term_args"),
    "long-term": ("long_term_policy", "long_term_args"),
    "snapshot-policy": ("snapshot_policy", "snapshot_args"),
    "kv-compression": ("kv_compression", "kv_compression_args"),
}
DEFAULT_PLOT = "sim-compare.png"


def policy_variant(text: str) -> tuple[str, str, tuple[tuple[str, object], ...]]:
    """'[KIND=]SPEC[,KEY=VALUE...]' -> (kind, spec, arguments)."""
    head, *rest = text.split(",")
    kind, _, spec = head.partition("=") if "=" in head else ("router", "", head)
    if kind not in POLICY_FIELDS:
        raise argparse.ArgumentTypeError(f"not a policy kind: {kind!r} (one of {', '.join(POLICY_FIELDS)})")
    return kind, arguments.policy(spec), tuple(arguments.policy_arg(item) for item in rest)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("compare (minifaas sim compare)")
    group.add_argument(
        "--policy", type=policy_variant, action="append", metavar="[KIND=]SPEC[,KEY=VALUE...]",
        help="a policy to compare (repeat, each policy once): KIND router (the default), short-term, long-term, "
        "snapshot-policy or kv-compression; SPEC a built-in or module:Class (default: none)",
    )  # fmt: skip
    group.add_argument("--plot", type=arguments.figure_file, metavar="FILE", default=DEFAULT_PLOT,
                       help=f"where compare draws its figures: {arguments.FIGURE_HELP}")  # fmt: skip


def kinds(args: argparse.Namespace) -> set[str]:
    """The kinds of policy compared (a short-term or long-term one turns its scheduler on for every policy)."""
    if args.policy and args.action != "compare":
        raise ValueError("--policy is for minifaas sim compare; to simulate one policy, name it (--router SPEC)")
    return {kind for kind, _, _ in args.policy or ()}


def variants(config: SimConfig, args: argparse.Namespace) -> dict[str, SimConfig]:
    """One SimConfig per --policy, named as it was given; ValueError for none, one given twice (the same
    simulation twice over), or a spec that does not load."""
    if not args.policy:
        raise ValueError("compare needs at least one --policy (e.g. --policy default --policy mymodule:MyRouter)")
    named = {}
    for kind, spec, policy_args in args.policy:
        spec_field, args_field = POLICY_FIELDS[kind]
        label = _label(kind, spec, policy_args)
        if label in named:
            raise ValueError(f"--policy {label} is given twice: name each policy to compare once")
        named[label] = replace(config, **{spec_field: spec, args_field: policy_args})
    return named


def _label(kind: str, spec: str, policy_args: tuple[tuple[str, object], ...]) -> str:
    head = spec if kind == "router" else f"{kind}={spec}"
    return ",".join([head, *(f"{k}={v}" for k, v in policy_args)])


def run(configs: dict[str, SimConfig], workload: Workload, args: argparse.Namespace) -> int:
    show = not args.no_progress and sys.stderr.isatty()
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"))
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), disable=not show) as progress:
        total = max(workload.duration_s, 1.0)
        tasks = {name: progress.add_task(name, total=total) for name in configs}
        results = compare(configs, workload, lambda name, now: progress.update(tasks[name], completed=min(now, total)))
        for task in tasks.values():
            progress.update(task, completed=total)
    notes = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the JSON object alone
    console = Console(stderr=True, width=None if sys.stderr.isatty() else PIPE_WIDTH) if args.json else stdout_console()
    title = f"{workload.name}: {len(workload):,} requests over {workload.duration_s:,.0f} s"
    print_comparison(results, title, console)
    if draw_or_say(args.plot, lambda png: plot_comparison(results, png)):
        print(f"plot: {args.plot}", file=notes)
    if args.json:
        print(figures.dumps({name: r.to_dict() for name, r in results.items()}))
    return 0


def print_comparison(results: dict[str, SimResult], title: str, console: Console) -> None:
    table = Table(title=title)
    table.add_column("policy")
    for header, _, _ in COLUMNS:
        table.add_column(header, justify="right")
    for name, result in results.items():
        table.add_row(name, *cells(result))
    console.print(table)
