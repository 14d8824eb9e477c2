"""`z bench tp`: zcore's tp 2 against DTensor and data parallelism, in one run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zstack.bench import load


def test_odd_global_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="--micro-batch 3 must be even"):
        load("tp").run(micro_batch=3)


@pytest.mark.slow(reason="2 ranks train three tiny GPTs (~60 s on 2 cores)")
def test_tiny_run_reports_every_contender_and_the_ratios() -> None:
    z = Path(sys.executable).parent / "z"
    cmd = [str(z), "bench", "tp", "--preset", "tiny", "--steps", "2", "--warmup", "1"]
    cmd += ["--micro-batch", "4", "--seq-len", "16", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["contenders"]) == {"zcore_tp", "dtensor_tp", "dtensor_tp_lp", "dp"}
    c = result["contenders"]
    # the same model and data: zcore's and DTensor's first losses agree
    for peer in ("dtensor_tp", "dtensor_tp_lp"):
        assert abs(c["zcore_tp"]["first_loss"] - c[peer]["first_loss"]) < 1e-4
    for key in ("vs_dtensor", "vs_dtensor_loss_parallel", "vs_dp", "state_vs_tp1"):
        assert result[key] > 0
    assert result["state_vs_tp1"] <= 0.55
    assert "zcore_tp / best dtensor" in load("tp").report(result)
