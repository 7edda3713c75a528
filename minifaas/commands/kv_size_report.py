"""``minifaas kv-size``: why a hybrid model's KV fits an ordinary inter-datacenter link."""

from __future__ import annotations

import argparse

from rich.table import Table

from minifaas import figures
from minifaas.commands import arguments
from minifaas.commands.main import BadInput, stdout_console, user_input
from minifaas.model.kv_size import kv_profile
from minifaas.model.layer_state import KVProfile
from minifaas.model.loader import DEFAULT_MODEL, MODELS_DIR, ModelSpec, load_config_dict, preset_names

DEFAULT_LENGTHS = (1024, 8192, 32768, 131072)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        action="append",
        type=arguments.model,
        metavar="PRESET|DIR|config.json",
        help=f"a preset ({', '.join(preset_names())}), a checkpoint dir or a config.json; "
        f"repeat to compare (default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--all-presets", action="store_true", help="every preset")
    parser.add_argument("--real-configs", action="store_true", help="every config in the repository's models/configs")
    parser.add_argument(
        "--lengths",
        type=arguments.positive_ints,
        default=",".join(str(n) for n in DEFAULT_LENGTHS),
        help="comma-separated prompt lengths in tokens",
    )
    parser.add_argument(
        "--baseline",
        help="a model shown, or any model, divided by each other's bytes: (Nx) means N times smaller than it "
        "(default: the first dense one)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    specs = list(args.model or [])
    if args.all_presets:
        specs += preset_names()
    if args.real_configs:
        specs += sorted(str(p) for p in (MODELS_DIR / "configs").glob("*.json"))
    lengths = args.lengths
    with user_input():
        profiles = [_profile(s) for s in (specs or [DEFAULT_MODEL])]
        baseline = _baseline(profiles, args.baseline)
    if args.json:
        print(figures.dumps({p.name: _as_dict(p, lengths, baseline) for p in profiles}))
        return 0
    console = stdout_console()
    for p in profiles:
        table = Table(title=f"{p.name}: state per request by layer kind")
        for col in ("layer kind", "layers", "bytes/token (growing)", "fixed bytes/request", "window"):
            table.add_column(col, justify="right" if col != "layer kind" else "left")
        for kind, (n, per_tok, fixed, window) in p.by_kind().items():
            table.add_row(kind, str(n), _fmt(per_tok), _fmt(fixed), str(window or "-"))
        console.print(table)
    summary = Table(
        title="bytes per request at each prompt length"
        + (f" ((Nx) = N times smaller than {baseline.name})" if baseline else "")
    )
    summary.add_column("model", no_wrap=True)
    for n in lengths:
        summary.add_column(f"{n // 1024}K" if n % 1024 == 0 else str(n), justify="right")
    for p in profiles:
        cells = []
        for n in lengths:
            ratio = f" ({baseline.bytes_at(n) / p.bytes_at(n):.1f}x)" if baseline and p is not baseline else ""
            cells.append(_fmt(p.bytes_at(n)) + ratio)
        summary.add_row(p.name, *cells)
    console.print(summary)
    return 0


def _profile(name_or_path: str) -> KVProfile:
    """The state sizes of a model from its config; a config that cannot give them is BadInput naming the file."""
    spec = ModelSpec.resolve(name_or_path)
    cfg = load_config_dict(spec)
    try:
        return kv_profile(cfg, spec.name)
    except KeyError as e:
        raise BadInput(f"{spec.path}: no setting {e.args[0]!r} in the config") from None
    except (ValueError, TypeError, ArithmeticError) as e:
        raise BadInput(f"{spec.path}: not a config kv-size can read ({type(e).__name__}: {e})") from None


def _baseline(profiles: list[KVProfile], name: str | None) -> KVProfile | None:
    if name:
        return next((p for p in profiles if p.name == name), None) or _profile(name)
    dense = [p for p in profiles if all(c.kind == "full_attention" for c in p.layers)]
    return dense[0] if dense and len(profiles) > 1 else None


def _as_dict(p: KVProfile, lengths: list[int], baseline: KVProfile | None) -> dict:
    return {
        "by_kind": {
            k: {"layers": n, "bytes_per_token": t, "fixed_bytes": f, "window": w}
            for k, (n, t, f, w) in p.by_kind().items()
        },
        "bytes_per_token": sum(c.bytes_per_token for c in p.layers if c.window is None),
        "fixed_bytes": sum(c.fixed_bytes for c in p.layers),
        "bytes_at": {str(n): p.bytes_at(n) for n in lengths},
        "ratio_vs_baseline": {str(n): baseline.bytes_at(n) / p.bytes_at(n) for n in lengths} if baseline else None,
    }


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
