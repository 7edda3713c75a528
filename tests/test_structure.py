"""The import graph of minifaas: no cycles, no policy module reaching into serving, lazy imports only where listed.

Read from the source with the ast module, so nothing is imported. The cycle
check counts module-level imports; an import inside a function is allowed only
where LAZY_IMPORTS gives its reason, and the layering checks count those too.
Imports under ``if TYPE_CHECKING:`` are for annotations and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minifaas"

# Policy code is sans-IO and shared with the simulator; it must not depend on the live system.
POLICY_PACKAGES = ("minifaas.policy", "minifaas.cache", "minifaas.planner", "minifaas.sim")
POLICY_EXCEPTIONS: set[str] = set()  # the live scheduler's driver is serving code (gateway/live_scheduler.py)
# the live system: the gateway, the workers, their launchers and the commands that start them
SERVING = ("minifaas.gateway", "minifaas.worker", "minifaas.launch", "minifaas.commands")
# Below the simulator and the live system: the planner (which the simulator drives), the router, the caches
# and the trace readers they share. None of them may import minifaas.sim or serving code, not even lazily.
LOWER_LAYERS = ("minifaas.planner", "minifaas.policy", "minifaas.cache", "minifaas.traces")

_TRANSFORMERS = "transformers imports in seconds, and only after select_kernels() has decided whether fla may load"
_PLOT = "matplotlib is the optional plot extra"
_TORCH_WHEN_PROFILING = "torch loads when profiling starts, not to parse flags"
_TORCH_FOR_A_MODEL_FLAG = "torch loads to check a --model, or that a CUDA device is there, not for every command"
_PRELOAD = "the pre-loaded parent imports a worker's modules only after select_kernels() has kept fla out"
_RAY = "ray is the optional ray extra, loaded only by the gateway that uses the Ray launcher"
# (module, what it imports inside a function) -> why the import is not at the top of the module
LAZY_IMPORTS = {
    ("minifaas.commands.arguments", "minifaas.model.loader"): _TORCH_FOR_A_MODEL_FLAG,
    ("minifaas.commands.arguments", "torch"): _TORCH_FOR_A_MODEL_FLAG,
    ("minifaas.commands.arguments", "minifaas.traces"): "numpy loads for a --trace flag, not in the link emulator",
    ("minifaas.model.layer_state", "transformers"): _TRANSFORMERS,
    ("minifaas.model.loader", "transformers"): _TRANSFORMERS,
    ("minifaas.model.state_layout", "transformers"): _TRANSFORMERS,
    ("minifaas.model.tokenizer", "transformers"): _TRANSFORMERS,
    ("minifaas.commands.profile_model", "minifaas.model.runtime"): _TORCH_WHEN_PROFILING,
    ("minifaas.commands.profile_model", "minifaas.model.batch_decoder"): _TORCH_WHEN_PROFILING,
    ("minifaas.commands.profile_model", "minifaas.model.decoder"): _TORCH_WHEN_PROFILING,
    ("minifaas.commands.profile_model", "minifaas.model.sampling"): _TORCH_WHEN_PROFILING,
    ("minifaas.planner.plot", "matplotlib"): _PLOT,
    ("minifaas.gateway.workers", "minifaas.launch.ray_actors"): _RAY,
    ("minifaas.launch.zygote", "minifaas.model.kernels"): _PRELOAD,
    ("minifaas.launch.zygote", "minifaas.model.loader"): _PRELOAD,
    ("minifaas.launch.zygote", "minifaas.worker.worker_process"): _PRELOAD,
    ("minifaas.launch.zygote", "transformers"): _PRELOAD,
    ("minifaas.sim.comparison", "matplotlib"): _PLOT,
    ("minifaas.sim.report", "matplotlib"): _PLOT,
    ("minifaas.train.checkpoint", "transformers"): _TRANSFORMERS,
    ("minifaas.train.tokenizer_files", "transformers"): _TRANSFORMERS,
    ("minifaas.train.train_log", "matplotlib"): _PLOT,
    ("minifaas.train.trainer", "transformers"): _TRANSFORMERS,
}


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module under ``package``."""
    files = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(body: list[ast.stmt], package: str) -> set[str]:
    """Every dotted name imported by statements that run when the module loads."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                names |= _imported_names(node.body, package)
            names |= _imported_names(node.orelse, package)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                names |= _imported_names(block, package)
    return names


def function_imports(tree: ast.Module, package: str) -> set[str]:
    """Every dotted name imported inside a function (or a method) of the module."""
    names: set[str] = set()
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names |= _imported_names([node], package)
    return names


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def every_import(tree: ast.Module, package: str) -> set[str]:
    """Every dotted name the module imports anywhere: at load time, inside functions, for type checking."""
    return {name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for name in _imported_names([node], package)}  # fmt: skip


def import_graph(files: dict[str, Path], lazy: bool = False, everything: bool = False) -> dict[str, set[str]]:
    """Module -> the minifaas modules it imports at load time (and inside its functions, if ``lazy``;
    anywhere at all, type-checking imports included, if ``everything``)."""
    graph = {}
    for name, path in files.items():
        tree, package = ast.parse(path.read_text()), _package_of(name, path)
        imported_names = _imported_names(tree.body, package)
        if lazy:
            imported_names |= function_imports(tree, package)
        if everything:
            imported_names |= every_import(tree, package)
        targets = set()
        for imported in imported_names:
            while imported and imported not in files:  # `from a.b import C` names module a.b
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that returns to its start, or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph.get(node, ())):
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done and (cycle := visit(target)):
                return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start)):
            return cycle
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(module_files(PACKAGE))


def test_the_graph_covers_the_package(graph: dict[str, set[str]]) -> None:
    assert "minifaas.gateway.gateway" in graph
    assert "minifaas.policy.router" in graph["minifaas.gateway.gateway"]
    assert "minifaas.model.layer_state" in graph["minifaas.transport.wire"]


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    assert find_cycle(graph) is None


def test_no_cycle_even_through_type_checking_imports() -> None:
    assert find_cycle(import_graph(module_files(PACKAGE), everything=True)) is None


def test_the_gateways_parts_do_not_import_it() -> None:
    """Role changes, prefill dispatch, the live scheduler and the rest get narrow collaborators, not the Gateway."""
    graph = import_graph(module_files(PACKAGE), everything=True)
    users = sorted(module for module, targets in graph.items() if "minifaas.gateway.gateway" in targets)
    # the command layer composes it, and the dashboard is a read-only view of the whole of it
    assert [u for u in users if not u.startswith("minifaas.commands.")] == ["minifaas.gateway.dashboard"], users


def test_no_policy_module_imports_serving(graph: dict[str, set[str]]) -> None:
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module.startswith(POLICY_PACKAGES) and module not in POLICY_EXCEPTIONS
        for target in targets
        if target.startswith(SERVING)
    )
    assert upward == []


def test_lower_layers_never_import_sim_or_serve() -> None:
    graph = import_graph(module_files(PACKAGE), lazy=True)
    assert "minifaas.traces" in graph["minifaas.planner.case"]
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module.startswith(LOWER_LAYERS)
        for target in targets
        if target.startswith(("minifaas.sim", *SERVING))
    )
    assert upward == []


def _lazy_reason(module: str, imported: str) -> str | None:
    return next((why for (m, top), why in LAZY_IMPORTS.items() if m == module and _within(imported, top)), None)


def _within(name: str, top: str) -> bool:
    return name == top or name.startswith(f"{top}.")


def test_imports_inside_functions_are_the_listed_lazy_ones() -> None:
    found = set()
    for name, path in module_files(PACKAGE).items():
        for imported in function_imports(ast.parse(path.read_text()), _package_of(name, path)):
            assert _lazy_reason(name, imported), f"{name} imports {imported} inside a function: move it to the top"
            found |= {key for key in LAZY_IMPORTS if key[0] == name and _within(imported, key[1])}
    assert sorted(set(LAZY_IMPORTS) - found) == [], "LAZY_IMPORTS lists imports that are gone"


def test_function_imports_are_found(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "import os\n\nclass A:\n    def f(self):\n        from .sim import run\n\n"
        "async def g():\n    import json.decoder\n"
    )
    tree = ast.parse((tmp_path / "m.py").read_text())
    assert function_imports(tree, "pkg") == {"pkg.sim", "pkg.sim.run", "json.decoder"}
    assert _lazy_reason("minifaas.model.loader", "transformers.cache_utils") == _TRANSFORMERS
    assert _lazy_reason("minifaas.model.loader", "transformersx") is None
    assert _lazy_reason("minifaas.planner.case", "transformers") is None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_type_checking_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n")
    (pkg / "b.py").write_text("from .sub import c\n\ndef f():\n    import pkg.a\n")
    (pkg / "sub" / "c.py").write_text("from ..a import X\n")
    graph = import_graph(module_files(pkg))
    assert graph["pkg.a"] == set()
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
