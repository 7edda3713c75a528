"""The package's layout, read from the source: folders import downward only, no monster functions or docstrings,
argparse in the command layer alone, one file per module name, and a reading list whose files exist.

The length caps are guards against monsters, not targets: a function is as long as its idea, and a docstring
says a purpose in a few lines (a module's may sketch its design in a few more).

A folder of minifaas (``minifaas.gateway``) or a top-level module (``minifaas.config``) is one *room*; an
import from one room into another is an arrow, whether it runs at load time or inside a function.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

from test_structure import module_files as modules

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = "commands"  # the command layer: every argparse flag and every program's entry point
MAX_FUNCTION_LINES = 80
MAX_DOCSTRING_LINES = 10  # a class's or a function's
MAX_MODULE_DOCSTRING_LINES = 15


def room(module: str, package: Path) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (package / parts[1]).is_dir() else module


def _imported(node: ast.AST, here: list[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
        return [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return []


def arrows(package: Path) -> dict[str, set[str]]:
    """Room -> the rooms it imports from, counting every import statement in the room's files."""
    found = modules(package)
    graph: dict[str, set[str]] = {room(m, package): set() for m in found}
    for name, path in found.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _imported(node, here):
                while target and target not in found:
                    target = target.rpartition(".")[0]
                if target and target != package.name and room(target, package) != room(name, package):
                    graph[room(name, package)].add(room(target, package))
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import loop between rooms that a depth-first walk meets, each as a path back to its start."""
    found: list[list[str]] = []
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> None:
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if target in path:
                found.append([*path[path.index(target) :], target])
            elif target not in done:
                walk(target, path)
        path.pop()
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            walk(start, [])
    return found


def _in_commands(path: Path, package: Path) -> bool:
    return path.relative_to(package).parts[0] == COMMANDS


def long_functions(package: Path) -> list[str]:
    """Functions longer than the limit outside the command layer."""
    return [
        f"{path.relative_to(package.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for path in sorted(package.rglob("*.py"))
        if not _in_commands(path, package)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES  # type: ignore[operator]
    ]


def long_docstrings(package: Path) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                cap = MAX_MODULE_DOCSTRING_LINES if isinstance(node, ast.Module) else MAX_DOCSTRING_LINES
                if doc and len(doc.splitlines()) > cap:
                    found.append(f"{path.relative_to(package.parent)}:{getattr(node, 'lineno', 1)}")
    return found


def argparse_outside_commands(package: Path) -> list[str]:
    """Files outside the command layer that build a parser or add a flag."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if _in_commands(path, package):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node.func, "attr", getattr(node.func, "id", "")) if isinstance(node, ast.Call) else ""
            if name in ("add_argument", "ArgumentParser", "add_subparsers", "add_argument_group"):
                found.append(str(path.relative_to(package.parent)))
                break
    return found


def duplicate_names(package: Path) -> list[str]:
    names = Counter(p.name for p in package.rglob("*.py") if p.name != "__init__.py")
    return sorted(name for name, n in names.items() if n > 1)


def reading_list(root: Path) -> tuple[list[str], int, list[str]]:
    """The files docs/READING.md lists, their lines together, and those that do not exist."""
    listed = sorted(set(re.findall(r"minifaas/[\w/]+\.py", (root / "docs" / "READING.md").read_text())))
    missing = [p for p in listed if not (root / p).is_file()]
    lines = sum(len((root / p).read_text().splitlines()) for p in listed if p not in missing)
    return listed, lines, missing


PACKAGE = ROOT / "minifaas"


def test_rooms_import_downward_only() -> None:
    graph = arrows(PACKAGE)
    assert {"minifaas.gateway", "minifaas.worker", "minifaas.net"} <= set(graph)
    assert "minifaas.net" in graph["minifaas.transport"]
    assert loops(graph) == []


def test_functions_are_short_outside_the_command_layer() -> None:
    assert long_functions(PACKAGE) == []


def test_docstrings_are_short() -> None:
    assert long_docstrings(PACKAGE) == []


def test_argparse_lives_in_the_command_layer() -> None:
    assert argparse_outside_commands(PACKAGE) == []


def test_no_two_modules_share_a_file_name() -> None:
    assert duplicate_names(PACKAGE) == []


def test_every_file_the_reading_list_names_exists() -> None:
    # which files it names is measured, not capped: tests/test_reading_list.py holds it to the files a request runs
    listed, _, missing = reading_list(ROOT)
    assert listed and missing == []


def test_each_check_catches_what_it_looks_for(tmp_path: Path) -> None:
    """A small package that breaks every rule once: each check names the break."""
    pkg = tmp_path / "pkg"
    for folder in ("a", "b", COMMANDS):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "one.py").write_text("from pkg.b.two import X\n")
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    doc = "\n".join(["'''Too long."] + ["more"] * MAX_MODULE_DOCSTRING_LINES + ["'''"])
    (pkg / "b" / "two.py").write_text(f"{doc}\nX = 1\n\n\ndef f():\n    import pkg.a.one\n{body}\n")
    fine = "\n".join(["'''Long for a class, not for a module."] + ["more"] * MAX_DOCSTRING_LINES + ["'''"])
    (pkg / "b" / "three.py").write_text(f"{fine}\nclass C:\n" + "\n".join(f"    {line}" for line in fine.split("\n")))
    (pkg / "b" / "flags.py").write_text("import argparse\nargparse.ArgumentParser().add_argument('--x')\n")
    (pkg / COMMANDS / "flags.py").write_text("def g():\n" + body + "\n")  # long, but in the command layer
    assert loops(arrows(pkg)) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert [entry.split()[1] for entry in long_functions(pkg)] == ["f"]
    assert long_docstrings(pkg) == [f"pkg/b/three.py:{MAX_DOCSTRING_LINES + 3}", "pkg/b/two.py:1"]
    assert argparse_outside_commands(pkg) == ["pkg/b/flags.py"]
    assert duplicate_names(pkg) == ["flags.py"]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "READING.md").write_text("1. `minifaas/gone.py`: not there\n")
    assert reading_list(tmp_path) == (["minifaas/gone.py"], 0, ["minifaas/gone.py"])
