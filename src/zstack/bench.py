"""`z bench NAME`: load `benchmarks/NAME.py` and print what its `run()` returns.

Benchmarks live in the repository's `benchmarks/` folder (shipped inside the
zstack wheel as `zstack/_benchmarks`). Each defines `run(**options) -> dict`
and `report(result) -> str`; the JSON object is always the last thing printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from zcore.bench import load as load_from
from zcore.bench import numbers

__all__ = ["benchmarks_dir", "load", "numbers", "run_benchmark"]


def benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "_benchmarks", here.parent.parent / "benchmarks"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"no benchmarks folder next to {here}; reinstall zstack (`make setup` in a checkout)"
    )


def load(name: str) -> ModuleType:
    """The benchmark module `name` of `benchmarks_dir()`, executed once per process
    (`zcore.bench.load`, which the benchmarks use for their helper modules)."""
    return load_from(name, benchmarks_dir())


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
