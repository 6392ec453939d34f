"""No two lit_trainer modules import each other, directly or through others (static: read with ``ast``, not run).

Every import statement counts, wherever it is: at module level, inside a function, or under ``TYPE_CHECKING`` (a
circle there still means two files that must be read together). ``from pkg import name`` is an edge to the submodule
``pkg.name`` when there is one, else to ``pkg``; relative imports are resolved. The implicit import of a parent package
(``lit_trainer.callbacks`` before ``lit_trainer.callbacks.bema``) is not an edge: it is how Python loads any submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lit_trainer"


def module_names(package: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under ``package`` (a package is its ``__init__.py``)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The dotted names one import statement in module ``name`` reaches."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = name.split(".") if is_package else name.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
    return submodules if len(submodules) == len(node.names) else [base, *submodules]


def import_graph(package: Path) -> dict[str, set[str]]:
    """``{module: modules of the same package it imports}``."""
    modules = module_names(package)
    root = package.name
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, name, is_package, modules):
                while target not in modules and "." in target:  # `pkg.mod.attr` -> `pkg.mod`
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name and target.split(".")[0] == root:
                    edges.add(target)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through every group of modules that import each other (Tarjan's components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, set(component)) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected ``component`` (breadth-first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not a cycle")


def test_lit_trainer_has_no_import_cycles():
    cycles = import_cycles(import_graph(PACKAGE))
    assert cycles == [], "modules that import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_finds_a_cycle_through_a_relative_and_a_type_checking_import(tmp_path: Path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.sub import loader\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "loader.py").write_text("from . import helpers\n")
    (package / "sub" / "helpers.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..sub.loader import Loader\n"
    )
    (package / "alone.py").write_text("import pkg.sub.helpers\nimport os\n")
    graph = import_graph(package)
    assert graph["pkg"] == {"pkg.sub.loader"}  # `from pkg.sub import loader` reaches the submodule, not pkg.sub
    assert graph["pkg.alone"] == {"pkg.sub.helpers"}
    assert import_cycles(graph) == [["pkg.sub.helpers", "pkg.sub.loader", "pkg.sub.helpers"]]
