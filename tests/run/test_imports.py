"""The package's import graph: no cycles among dpbench's modules, counting imports inside
functions, and the option vocabulary a leaf.

Edges are read from the source (ast), so an import inside a function counts as much as one at the
top. Importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first: those packages are edges
too, except the importing module's own ancestors (already being imported). A registry's discovery
(`Registry(package=...)` importing every module of its package by name) is not an import statement
and is not counted: that is the one sanctioned way a package reaches modules that import it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.config import REPO

PACKAGE = REPO / "dpbench"


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def imported_names(module: str, path: Path) -> list[str]:
    """Every dotted name an import statement of `module` reaches, resolved to absolute form."""
    own_package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own_package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            names += [f"{prefix}.{alias.name}" for alias in node.names]  # a submodule, or a name in prefix
    return names


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    graph = {}
    for module, path in files.items():
        edges = set()
        for name in imported_names(module, path):
            while name and name not in files:  # `from pkg import name`: the module is pkg
                name = name.rpartition(".")[0]
            if not name or name == module:
                continue
            edges.add(name)
            parent = name.rpartition(".")[0]
            while parent and parent != "dpbench":  # dpbench/__init__ imports only its _compat shim
                if not module.startswith(parent + ".") and parent != module:
                    edges.add(parent)
                parent = parent.rpartition(".")[0]
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
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
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert "dpbench.algorithms.base" in graph["dpbench.algorithms"]
    assert "dpbench.options" in graph["dpbench.algorithms.grape"]
    assert "dpbench.run" in graph["dpbench.tools.audit.one_run"]  # an import inside a function counts


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_dpbench_modules():
    assert cycles(import_graph()) == []


@pytest.mark.slow  # a fresh interpreter
def test_the_option_vocabulary_is_a_leaf():
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, dpbench.options; print(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout.split()
    assert "dpbench.options" in imported
    assert not [m for m in imported if m.startswith(("dpbench.algorithms", "dpbench.schema", "dpbench.run"))]


def test_the_release_reaches_no_algorithm():
    """dpbench.privacy.release serves releases outside training too: nothing it imports, however
    indirectly (imports inside functions included), is an algorithm."""
    graph, reached, todo = import_graph(), set(), ["dpbench.privacy.release"]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    assert "dpbench.runtime.distributed" in reached
    assert not [m for m in reached if m.startswith("dpbench.algorithms")]
