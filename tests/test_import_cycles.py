"""No import cycle inside a package.

Every module of every package (`packages/*/src/*`, `src/zstack`, `native/python/znative`)
is read with `ast` (nothing is executed) and each import that names a module of the same
package becomes an edge: module-level and function-level imports alike (a function-level
import is how a cycle usually hides), relative imports resolved, and
`from pkg import name` pointing at the submodule `pkg.name` when there is one, else at
`pkg` itself. A package has a cycle when its graph has a strongly connected component of
more than one module (Tarjan); the failure prints one concrete path through it, file and
line per edge.

Not counted: imports under `if TYPE_CHECKING:` (they never run; a type named in an
annotation is how a seam's two sides refer to each other), and the implicit import of a
submodule's parent packages (every package would be a cycle with its lazy-export
`__init__`).
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


# KNOWN CYCLES, to be untangled and then deleted from here (issue 24). Each entry is the
# import that closes one cycle found when this test was written, in a package others were
# restructuring at the time; the test drops that edge and requires the rest of the graph to
# be acyclic, so a new cycle still fails. An entry whose edge is gone, or no longer closes a
# cycle, fails `test_known_cycles_still_exist` until it is removed. Never add one to make a
# new cycle pass.
KNOWN_CYCLES: dict[str, set[tuple[str, str]]] = {}


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


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` (their `else` runs)."""
    found: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def import_edges(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """Every import in `path` (any depth in the file, outside `if TYPE_CHECKING:`) of a
    module of the same package."""
    top = module.split(".")[0]
    is_package = path.name == "__init__.py"
    found: list[Edge] = []

    def add(name: str, line: int) -> None:
        target = _resolve(name, modules)
        if target is not None and target != module:
            found.append(Edge(target, path, line))

    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
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


def _without(graph: dict[str, list[Edge]], edges: set[tuple[str, str]]) -> dict[str, list[Edge]]:
    return {m: [e for e in out if (m, e.target) not in edges] for m, out in graph.items()}


@pytest.mark.parametrize("root", PACKAGES, ids=lambda p: p.name)
def test_no_import_cycle(root: Path) -> None:
    graph = _without(import_graph(root), KNOWN_CYCLES.get(root.name, set()))
    cycles = strongly_connected(graph)
    assert not cycles, f"import cycle(s) in {root.name}; untangle them:\n" + "\n".join(
        describe(graph, c) for c in cycles
    )


def test_known_cycles_still_exist() -> None:
    gone = []
    for name, edges in sorted(KNOWN_CYCLES.items()):
        graph = import_graph(next(p for p in PACKAGES if p.name == name))
        components = strongly_connected(graph)
        gone += [
            (a, b)
            for a, b in sorted(edges)
            if not any(e.target == b for e in graph.get(a, []))
            or not any(a in c and b in c for c in components)
        ]
    assert not gone, f"no longer closes a cycle; remove from KNOWN_CYCLES: {gone}"


def test_scanner_sees_every_form(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")
    (pkg / "a.py").write_text("from . import b\nfrom .sub import c\n")
    (pkg / "b.py").write_text("import os\nimport pkg.sub.c as c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def f():\n    from .. import d\n")
    (pkg / "d.py").write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    from pkg import e\nelse:\n"
        "    from pkg.sub import c\n"
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
