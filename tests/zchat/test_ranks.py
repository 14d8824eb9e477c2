"""zchat.ranks: a `z chat` stage's ranks return their values in rank order, a failing rank
fails the call naming it, and the ranks die with the process that started them (a script
calling run_on_ranks is killed with SIGKILL while its 2 ranks run; both ranks are gone
within 10 s)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.utils.processes import alive, still_alive_after
from zchat.ranks import RankFailed, run_on_ranks


def _sum_and_threads(rank: int, world: int, x: float) -> tuple[list[float], int]:
    t = torch.tensor([rank + x])
    dist.all_reduce(t)
    if rank == 1 and x < 0:
        raise ValueError(f"bad shard {x}")
    return t.tolist(), torch.get_num_threads()


# Two spawned interpreters importing torch per call: 30-60 s on a loaded 2-core machine. The
# default suite runs the same zcore.ranks machinery through tests/utils/test_distributed.py.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_return_in_order_and_a_failed_rank_is_named() -> None:
    assert run_on_ranks(_sum_and_threads, 2, (10.0,), threads=1) == [([21.0], 1)] * 2
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 raised:.*ValueError: bad shard -5"):
        run_on_ranks(_sum_and_threads, 2, (-5.0,), timeout_s=120)


SCRIPT = """
import os, sys, time
from pathlib import Path
from zchat.ranks import run_on_ranks

def sleeper(rank, world, out):
    Path(out, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(300)

if __name__ == "__main__":
    run_on_ranks(sleeper, 2, (sys.argv[1],))
"""


def test_ranks_die_with_a_killed_parent(tmp_path: Path) -> None:
    script = tmp_path / "stage.py"
    script.write_text(SCRIPT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        files = [tmp_path / f"rank{r}.pid" for r in range(2)]
        deadline = time.monotonic() + 40
        while not all(f.is_file() and f.read_text() for f in files):
            assert parent.poll() is None, "the parent exited before both ranks started"
            assert time.monotonic() < deadline, "ranks did not start in 40 s"
            time.sleep(0.1)
        pids = [int(f.read_text()) for f in files]
        assert all(alive(pid) for pid in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
    assert still_alive_after(pids, 10) == []
