"""`z bench hf-trainer`: zcore.hf.Trainer against transformers' DDP Trainer on real ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
Z = Path(sys.executable).parent / "z"


def test_unknown_modes_are_named_before_any_rank_starts() -> None:
    proc = subprocess.run(
        [str(Z), "bench", "hf-trainer", "--model", "tiny", "--modes", "zero2,zero9", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "zero9" in proc.stdout + proc.stderr


@pytest.mark.slow(reason="6 launches of 2 fresh ranks that import transformers (~90 s)")
def test_bench_hf_trainer_prints_both_engines_and_ratios() -> None:
    args = ["--model", "tiny", "--steps", "2", "--warmup", "1", "--seq", "16", "--json"]
    proc = subprocess.run(
        [str(Z), "bench", "hf-trainer", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["baseline"] == "ddp" and result["world_size"] == 2
    assert set(result["modes"]) == {"zero2", "zero3", "lora3"}
    for row in result["modes"].values():
        for engine in ("zcore", "ddp"):
            assert row[engine]["step_s"] > 0 and row[engine]["peak_rss_mb"] > 0
        assert row["step_ratio"] > 0 and row["rss_ratio"] > 0
