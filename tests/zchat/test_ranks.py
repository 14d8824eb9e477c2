"""zchat.ranks: the ranks of a `z chat` stage die with the process that started them. A
script calling run_on_ranks is killed with SIGKILL while its 2 ranks run; both ranks are
gone within 10 s (before the fix they ran on, holding GiBs, until they finished)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.utils.processes import alive, still_alive_after

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
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
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
