"""What the scripts of a checkout's `benchmarks/` folder share with `z bench`: loading a
benchmark module by name, once per process, and reading comma-separated numeric options.

A benchmark may import the library packages but not the `z` CLI (`tests/test_layout.py`), so
these live here, below every package a benchmark measures; `zstack.bench` (what `z bench NAME`
runs) loads through the same function, so a benchmark module and the helper modules it loads
(`_ranks`, `_netns`, ...) are one module object each in a process, whoever loads them first.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

MODULE_PREFIX = "zstack_benchmarks"
"""Benchmark `NAME` is `sys.modules[f"{MODULE_PREFIX}.{NAME}"]` once loaded."""


def load(name: str, folder: str | os.PathLike[str]) -> ModuleType:
    """The benchmark module `folder/name.py`, executed once per process (a command that checks
    its options with the module and then runs it loads it twice). A benchmark loads a helper
    module beside it with `load("_ranks", Path(__file__).parent)`."""
    cached = sys.modules.get(f"{MODULE_PREFIX}.{name}")
    if cached is not None:
        return cached
    path = Path(folder) / f"{name}.py"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.py") if not p.stem.startswith("_"))
        raise FileNotFoundError(
            f"no benchmark `{name}` in {path.parent}; known: {', '.join(known)}"
        )
    spec = importlib.util.spec_from_file_location(f"{MODULE_PREFIX}.{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]  # a failed load is not cached half-run
        raise
    return module


def numbers(
    flag: str, text: str, kind: type[int] | type[float] = int, count: int | None = None
) -> list[Any]:
    """A comma-separated option (``--stages 0,1,2``) as numbers; ValueError naming ``flag``
    and the bad item otherwise."""
    items = [t.strip() for t in str(text).split(",")]
    out = []
    for item in items:
        try:
            out.append(kind(item))
        except ValueError:
            raise ValueError(
                f"{flag} {text!r}: {item!r} is not {'an integer' if kind is int else 'a number'}; "
                f"give comma-separated {'integers' if kind is int else 'numbers'}, e.g. "
                f"{'1,2' if kind is int else '0.5,1'}"
            ) from None
    if count is not None and len(out) != count:
        raise ValueError(
            f"{flag} {text!r}: expected {count} comma-separated values, got {len(out)}"
        )
    return out
