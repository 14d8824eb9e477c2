"""`z bench zero-step`: one real 2-rank run of a tiny GPT through zcore, JSON fields checked.

DeepSpeed is not installed in the test environment, so its side must come back as
``null`` with the reason. Timings are not asserted (benchmarks measure; tests check
behaviour).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from zstack.bench import load

ROOT = Path(__file__).resolve().parents[2]


def test_bench_zero_step_tiny_two_ranks() -> None:
    z = Path(sys.executable).parent / "z"
    proc = subprocess.run(
        [
            str(z),
            "bench",
            "zero-step",
            "--preset",
            "tiny",
            "--stages",
            "3",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--micro-batch",
            "2",
            "--seq",
            "32",
            "--world-size",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "zero_step"
    assert result["world_size"] == 2 and result["steps"] == 2 and result["warmup"] == 1
    assert 1_000_000 < result["params"] < 1_200_000  # the tiny preset
    assert result["config"]["optimizer"]["type"] == "AdamW"
    [row] = result["stages"]
    assert row["stage"] == 3
    ours = row["ours"]
    assert ours["median_step_s"] > 0 and len(ours["step_s"]) == 2
    assert set(ours["phases_median_s"]) == {"forward", "backward", "step"}
    assert len(ours["peak_rss_mb"]) == 2 and all(m > 0 for m in ours["peak_rss_mb"])
    assert len(ours["losses"]) == 3 and all(math.isfinite(x) for x in ours["losses"])
    assert 6.0 < ours["final_loss"] < 9.0  # ~ln(2048) on random tokens
    assert ours["optimizer"].endswith("CPUAdam") and ours["torch_threads"] == 1
    if result["deepspeed_version"] is None:
        assert row["deepspeed"] is None and "deepspeed" in result["deepspeed_status"]
        assert "step_time_ratio_ours_over_ds" not in row
    else:
        assert row["step_time_ratio_ours_over_ds"] > 0


def test_summary_takes_the_slowest_rank_per_step() -> None:
    bench = load("zero_step")

    def rank(total: list[float], peak: float) -> dict:
        times = {k: total for k in ("forward", "backward", "step", "total", "cpu")}
        side = {
            "times": times,
            "losses": [7.0, 6.0],
            "optimizer": "o",
            "zero_optimizer": "z",
            "profile": None,
        }
        process = {
            "peak_rss_mb": peak,
            "rss_before_init_mb": 1.0,
            "rss_after_init_mb": 2.0,
            "torch_threads": 1,
        }
        return {"process": process, "sides": {"ours": side}}

    run = [rank([1.0, 3.0], 10.0), rank([2.0, 1.0], 20.0)]
    s = bench._summary([run], [run], "ours")
    assert s["step_s"] == [2.0, 3.0] and s["median_step_s"] == 2.5
    assert s["peak_rss_mb"] == [10.0, 20.0] and s["final_loss"] == 6.0


def test_bench_zero_step_rejects_bad_stage() -> None:
    with pytest.raises(ValueError, match="'1,5'"):
        load("zero_step").run(stages="1,5")
