"""`z bench speculative` end to end on a tiny size: one JSON object last, plain measured
in the same run as each drafter, outputs checked identical; bad options are one line.
Timings are not asserted (benchmarks measure; tests check behaviour)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

Z = str(Path(sys.executable).parent / "z")


def run_z(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([Z, *args], capture_output=True, text=True, timeout=600)


def test_bench_speculative_prints_one_json_object_with_the_baseline() -> None:
    out = run_z(
        "bench",
        "speculative",
        "--workloads",
        "copy",
        "--concurrency",
        "1",
        "--num-prompts",
        "1",
        "--max-tokens",
        "12",
        "--modes",
        "ngram",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "speculative" and result["ok"] is True
    rows = result["results"]["copy/c1"]
    assert set(rows) == {"plain", "ngram"}  # plain is always run: the speedup's baseline
    assert rows["plain"]["speedup"] == 1.0
    ng = rows["ngram"]
    assert ng["identical_to_plain"] and ng["tokens"] == rows["plain"]["tokens"] == 12
    assert ng["proposed"] > 0 and 0 < ng["acceptance_rate"] <= 1
    assert ng["target_forwards"] < rows["plain"]["target_forwards"]


def test_bench_speculative_rejects_an_unknown_mode() -> None:
    out = run_z("bench", "speculative", "--modes", "medusa")
    assert out.returncode == 2
    assert "medusa" in out.stderr and "self-draft" in out.stderr
