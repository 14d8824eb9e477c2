"""`z bench NAME`: load `benchmarks/NAME.py` and print what its `run()` returns.

Benchmarks live in the repository's `benchmarks/` folder (shipped inside the
zstack wheel as `zstack/_benchmarks`). Each defines `run(**options) -> dict`
and `report(result) -> str`; the JSON object is always the last thing printed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "_benchmarks", here.parent.parent / "benchmarks"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"no benchmarks folder next to {here}; reinstall zstack (`make setup` in a checkout)"
    )


def load(name: str) -> ModuleType:
    """The benchmark module `name`, executed once per process (a command that checks
    its options with the module and then runs it loads it twice)."""
    cached = sys.modules.get(f"zstack_benchmarks.{name}")
    if cached is not None:
        return cached
    path = benchmarks_dir() / f"{name}.py"
    if not path.is_file():
        known = sorted(p.stem for p in benchmarks_dir().glob("*.py") if not p.stem.startswith("_"))
        raise FileNotFoundError(
            f"no benchmark `{name}` in {path.parent}; known: {', '.join(known)}"
        )
    spec = importlib.util.spec_from_file_location(f"zstack_benchmarks.{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def numbers(flag: str, text: str, kind: type[int] | type[float] = int,
            count: int | None = None) -> list[Any]:  # fmt: skip
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


def run_benchmark(name: str, json_only: bool, **options: Any) -> int:
    """Run benchmark ``name`` and print its report and JSON. Returns the exit code: 0; 1
    when the result says a check failed (``"ok": false``); 2 for bad options or a missing
    file or directory, reported as one line naming the problem (no traceback)."""
    try:
        module = load(name)
        result = module.run(**options)
    except (ValueError, OSError) as exc:
        print(f"error: z bench {name}: {exc}", file=sys.stderr)
        return 2
    if not json_only and hasattr(module, "report"):
        print(module.report(result))
    print(json.dumps(result))
    if result.get("ok") is False:
        print(f"error: z bench {name}: a check failed; see the report above", file=sys.stderr)
        return 1
    return 0
