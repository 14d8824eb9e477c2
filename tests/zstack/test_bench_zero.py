"""`z bench zero`: measured model-state bytes per rank next to the formula, on real ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_zero_measures_within_10pct_of_formula() -> None:
    z = Path(sys.executable).parent / "z"
    proc = subprocess.run(
        [str(z), "bench", "zero", "--world-size", "2", "--preset", "small", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["params"] > 1_000_000
    assert [r["stage"] for r in result["stages"]] == [0, 1, 2, 3]
    for r in result["stages"]:
        assert r["within_10pct"], r
        assert r["measured"]["total"] > 0
    stage = {r["stage"]: r["measured"] for r in result["stages"]}
    # what each stage partitions really shrinks
    assert stage[1]["optimizer"] < stage[0]["optimizer"] / 1.9
    assert stage[2]["grads"] < stage[1]["grads"] / 1.9
    assert stage[3]["params"] < stage[2]["params"] / 1.5
