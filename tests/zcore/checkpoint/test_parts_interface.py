"""The checkpointer reads the engine only through :mod:`zcore.checkpoint.parts`.

Read with ``ast`` (nothing is executed), like ``tests/test_layout.py``'s import checks:
the modules of ``zcore/checkpoint/`` import neither the engine nor the optimizer, name
neither, and every attribute they read from a :class:`CheckpointParts` (or from a part or
place taken out of it) is a member of the interface that part is declared with.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from zcore.checkpoint import parts as iface

ROOT = Path(__file__).resolve().parents[3] / "packages/zcore/src/zcore/checkpoint"
MODULES = sorted(p for p in ROOT.glob("*.py") if p.name != "parts.py")
FORBIDDEN_IMPORTS = (
    "zcore.engine",
    "zcore.zero.optimizer",
    "zcore.zero.store",
    "zcore.zero.stage3",
)
FORBIDDEN_NAMES = {"engine", "zopt", "ZEngine", "ZeroOptimizer", "stage3", "module"}
DICT = {"get", "items", "keys", "values", "__contains__"}


def _members(cls: type) -> dict[str, str]:
    """Each member of an interface class -> the name of its declared type ("" if none)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass.__module__ == "typing":
            continue
        for name, ann in vars(klass).get("__annotations__", {}).items():
            out[name] = str(ann).split("[")[0]
        for name, value in vars(klass).items():
            if callable(value) and not name.startswith("__"):
                out.setdefault(name, "")
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            out[f.name] = str(f.type).split("[")[0]
    return out


INTERFACES = {
    name: _members(obj)
    for name, obj in vars(iface).items()
    if isinstance(obj, type) and obj.__module__ == iface.__name__
}


def _type_of(node: ast.AST, known: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return known.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _type_of(node.value, known)
        if owner in INTERFACES:
            return INTERFACES[owner].get(node.attr) or None
    return None


def _violations(tree: ast.Module) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(FORBIDDEN_IMPORTS):
                bad.append(f"line {node.lineno}: imports {node.module}")
        if isinstance(node, ast.Import):
            bad += [
                f"line {node.lineno}: imports {a.name}"
                for a in node.names
                if a.name.startswith(FORBIDDEN_IMPORTS)
            ]
        if isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            bad.append(f"line {node.lineno}: names `{node.id}`")
        if isinstance(node, ast.arg) and node.arg in FORBIDDEN_NAMES:
            bad.append(f"line {node.lineno}: takes `{node.arg}`")
        if not isinstance(node, ast.FunctionDef):
            continue
        known: dict[str, str] = {}
        for a in node.args.args:
            ann = a.annotation
            if isinstance(ann, ast.Name) and ann.id in INTERFACES:
                known[a.arg] = ann.id
            elif isinstance(ann, ast.Constant) and str(ann.value) in INTERFACES:
                known[a.arg] = str(ann.value)
        for sub in ast.walk(node):  # names bound to a part or a place taken out of one
            if isinstance(sub, ast.Assign):
                for target in sub.targets:
                    pairs = (
                        zip(target.elts, sub.value.elts, strict=False)
                        if isinstance(target, ast.Tuple) and isinstance(sub.value, ast.Tuple)
                        else [(target, sub.value)]
                    )
                    for t, v in pairs:
                        kind = _type_of(v, known)
                        if isinstance(t, ast.Name) and kind:
                            known[t.id] = kind
        for sub in ast.walk(node):
            if not isinstance(sub, ast.Attribute):
                continue
            owner = _type_of(sub.value, known)
            if owner in INTERFACES and sub.attr not in INTERFACES[owner]:
                bad.append(f"line {sub.lineno}: reads `{sub.attr}` of a {owner}")
            if owner == "dict" and sub.attr not in DICT:
                bad.append(f"line {sub.lineno}: reads `{sub.attr}` of a dict part")
    return bad


def test_the_interface_is_what_the_checker_reads() -> None:
    assert {"place", "counters", "sharded", "model", "per_rank", "whole"} <= set(
        INTERFACES["CheckpointParts"]
    )
    assert INTERFACES["CheckpointParts"]["sharded"] == "ShardedPart"
    assert {"layouts", "owns", "state_dict", "load_state_dict"} <= set(INTERFACES["ShardedPart"])
    assert typing.get_type_hints  # the members come from the classes, not from this file


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_checkpoint_module_reads_only_the_parts_interface(path: Path) -> None:
    bad = _violations(ast.parse(path.read_text()))
    assert not bad, f"{path.name} reaches past zcore.checkpoint.parts: " + "; ".join(bad)


def test_the_check_catches_an_engine_attribute() -> None:
    src = (
        "def save(parts: CheckpointParts) -> None:\n"
        "    sharded = parts.sharded\n"
        "    sharded.store\n"
        "    parts.place.data_rank\n"
        "    parts.whole.get('x')\n"
    )
    bad = _violations(ast.parse(src))
    assert bad == [
        "line 3: reads `store` of a ShardedPart",
        "line 4: reads `data_rank` of a RankPlace",
    ]
    assert _violations(ast.parse("def f(engine):\n    engine.zopt\n"))


def test_stores_see_a_partition_not_the_optimizer() -> None:
    """A state store gets a :class:`~zcore.zero.partition.Partition` in ``attach``; neither
    zcore's store module nor zoffload's stores import the optimizer."""
    repo = Path(__file__).resolve().parents[3]
    stores = [repo / "packages/zcore/src/zcore/zero/store.py"]
    stores += sorted((repo / "packages/zoffload/src/zoffload").glob("*.py"))
    bad = []
    for path in stores:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "zcore.zero.optimizer":
                bad.append(f"{path.name}:{node.lineno}")
    assert not bad, f"stores import ZeroOptimizer: {bad}; take a Partition in attach()"
