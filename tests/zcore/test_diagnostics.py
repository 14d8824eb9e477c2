"""A dead or stuck rank ends the job with a message naming rank, collective and step."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, make_model, train
from zcore.comm import CollectiveError


def _dies(rank: int, world: int, stage: int, report: str) -> None:
    engine, *_ = zcore.initialize(make_model(), config=config(stage, comm_timeout_s=20))
    train(engine, 2)
    if engine.rank == 1:
        os._exit(3)
    try:
        train(engine, 1, start=2)
    except CollectiveError as err:
        msg = str(err)
    else:
        msg = "no error"
    # the harness reports rank 1's death, not what rank 0 returned: leave it a file
    Path(report).write_text(msg)


def _stuck(rank: int, world: int) -> tuple[str, float]:
    engine, *_ = zcore.initialize(make_model(), config=config(2, comm_timeout_s=3))
    # start-up on a busy 2-core machine can skew ranks by seconds: only time the stuck step
    engine.comm.timeout_s = 60
    train(engine, 1)
    engine.comm.barrier("test barrier")
    engine.comm.timeout_s = 3
    if engine.rank == 1:
        time.sleep(12)  # alive but never joins the next collective
        return "", 0.0
    start = time.monotonic()
    try:
        train(engine, 1, start=1)
    except CollectiveError as err:
        return str(err), time.monotonic() - start
    return "no error", 0.0


def test_dead_rank_is_reported_with_step_and_collective(tmp_path: Path) -> None:
    report = tmp_path / "rank0.txt"
    with pytest.raises(AssertionError, match="rank 1 of 2 exited with exit code 3"):
        run_ranks(_dies, 2, args=(2, str(report)), timeout=60)
    assert report.exists(), "rank 0 did not report the failed collective before it was stopped"
    msg = report.read_text()
    # this rank, the collective and the step it failed in, and the rank to look at
    assert msg.startswith("rank 0/2: collective `"), msg
    assert re.search(r"collective `[a-z_]+\(.+\)` at step 2 failed: ", msg), msg
    assert "the peer rank 1 may have died" in msg, msg
    assert "did not complete within" not in msg, msg  # gloo saw the peer go: not a timeout


def test_stuck_rank_times_out_with_a_named_collective() -> None:
    (msg, waited), _ = run_ranks(_stuck, 2, timeout=60)
    assert "rank 0/2" in msg and "step 1" in msg and "did not complete within 3s" in msg, msg
    assert waited < 10
