"""No import cycle inside a package.

Every module of every package (`packages/*/src/*`, `src/zstack`, `native/python/znative`)
is read with `ast` (nothing is executed) and each import that names a module of the same
package becomes an edge: module-level and function-level imports alike (a function-level
import is how a cycle usually hides), relative imports resolved, and
`from pkg import name` pointing at the submodule `pkg.name` when there is one, else at
`pkg` itself. Imports under `if TYPE_CHECKING:` count too: they never run, but the
dependency they state is as real as any other. A package has a cycle when its graph has a
strongly connected component of more than one module (Tarjan); the failure prints one
concrete path through it, file and line per edge.

Importing a submodule also runs its parent packages' `__init__`; that implicit edge is not
counted (every package would be a cycle with its lazy-export `__init__`), only the imports
written down.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _package_roots() -> list[Path]:
    roots = [ROOT / "src" / "zstack", ROOT / "native" / "python" / "znative"]
    roots += sorted(p for p in (ROOT / "packages").glob("*/src/*") if (p / "__init__.py").is_file())
    return roots


# KNOWN CYCLES, to be untangled and then deleted from here (issue 24): found when this test
# was written, in packages being restructured by others at the time. Each entry is the exact
# set of modules of one cycle; a cycle that grows or a new one still fails, and an entry
# whose cycle is gone fails `test_known_cycles_still_exist` until it is removed. Never add
# one to make a new cycle pass.
KNOWN_CYCLES: dict[str, list[frozenset[str]]] = {
    "zcore": [
        # engine.save_checkpoint imports zcore.checkpoint (function level); its restore and
        # sharded modules import zcore.engine under TYPE_CHECKING (for ZEngine).
        frozenset(
            {
                "zcore.checkpoint",
                "zcore.checkpoint.consolidate",
                "zcore.checkpoint.restore",
                "zcore.checkpoint.sharded",
                "zcore.engine",
            }
        ),
    ],
    "zstack": [
        # cli imports cmd_train to register it; cmd_train imports zstack.cli (function level)
        # for its file path, to start ranks with the `z` entry point.
        frozenset({"zstack.cli", "zstack.cmd_train"}),
        # data imports the Tokenizer type (TYPE_CHECKING); tokenizer imports data's corpus
        # helpers (function level).
        frozenset({"zstack.recipes.data", "zstack.recipes.tokenizer"}),
    ],
}


@dataclass(frozen=True)
class Edge:
    target: str
    path: Path
    line: int


def module_names(root: Path) -> dict[str, Path]:
    """`{dotted module name: file}` of the package at `root` (its folder name is the top)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """`name` if it is a module of the package, else its longest prefix that is."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_edges(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """Every import in `path` (any depth in the file) of a module of the same package."""
    top = module.split(".")[0]
    is_package = path.name == "__init__.py"
    found: list[Edge] = []

    def add(name: str, line: int) -> None:
        target = _resolve(name, modules)
        if target is not None and target != module:
            found.append(Edge(target, path, line))

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == top:
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] != top:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in modules else source, node.lineno)
    return found


def import_graph(root: Path) -> dict[str, list[Edge]]:
    modules = module_names(root)
    return {name: import_edges(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, list[Edge]]) -> list[frozenset[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for edge in graph[v]:
            w = edge.target
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: dict[str, list[Edge]], component: frozenset[str]) -> str:
    """One cycle through `component`, an edge per line: `a -> b  (file:line)`."""
    start = min(component)
    # Shortest path from start back to itself, inside the component (BFS).
    came: dict[str, tuple[str, Edge]] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for edge in graph[v]:
            if edge.target not in component or edge.target in came:
                continue
            came[edge.target] = (v, edge)
            if edge.target == start:
                queue.clear()
                break
            queue.append(edge.target)
    steps = []
    v = start
    while True:
        prev, edge = came[v]
        where = edge.path.relative_to(ROOT) if edge.path.is_relative_to(ROOT) else edge.path
        steps.append(f"  {prev} -> {v}  ({where}:{edge.line})")
        v = prev
        if v == start:
            break
    return f"{sorted(component)}:\n" + "\n".join(reversed(steps))


PACKAGES = _package_roots()


@pytest.mark.parametrize("root", PACKAGES, ids=lambda p: p.name)
def test_no_import_cycle(root: Path) -> None:
    graph = import_graph(root)
    known = set(KNOWN_CYCLES.get(root.name, []))
    cycles = [c for c in strongly_connected(graph) if c not in known]
    assert not cycles, f"import cycle(s) in {root.name}; untangle them:\n" + "\n".join(
        describe(graph, c) for c in cycles
    )


@pytest.mark.parametrize("name", sorted(KNOWN_CYCLES))
def test_known_cycles_still_exist(name: str) -> None:
    root = next(p for p in PACKAGES if p.name == name)
    found = set(strongly_connected(import_graph(root)))
    gone = [sorted(c) for c in KNOWN_CYCLES[name] if c not in found]
    assert not gone, f"no longer a cycle in {name}; remove from KNOWN_CYCLES: {gone}"


def test_scanner_sees_every_form(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("from . import b\nfrom .sub import c\n")
    (pkg / "b.py").write_text("import os\nimport pkg.sub.c as c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def f():\n    from .. import d\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import c\n"
    )
    (pkg / "e.py").write_text("from pkg import f\n")  # a name of pkg/__init__.py
    graph = import_graph(pkg)
    targets = {m: sorted(e.target for e in edges) for m, edges in graph.items()}
    assert targets == {
        "pkg": ["pkg.a"],
        "pkg.a": ["pkg.b", "pkg.sub.c"],
        "pkg.b": ["pkg.sub.c"],
        "pkg.sub": [],
        "pkg.sub.c": ["pkg.d"],
        "pkg.d": ["pkg.sub.c"],
        "pkg.e": ["pkg"],
    }
    (cycle,) = strongly_connected(graph)
    assert cycle == {"pkg.sub.c", "pkg.d"}
    assert "pkg.d -> pkg.sub.c" in describe(graph, cycle)
