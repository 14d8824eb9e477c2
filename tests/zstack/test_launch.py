"""`z launch`: the torchrun argv it builds, and real 2-rank gloo runs through the CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.run import parse_args as torchrun_parse_args

from tests.utils.distributed import free_port
from tests.utils.processes import alive, still_alive_after
from zstack.launch import RANK_ENTRY, LaunchError, build_argv
from zstack.rank_entry import LAUNCHER_PID

Z = Path(sys.executable).parent / "z"

SCRIPT = """\
import argparse, json, os
from pathlib import Path

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--fail-rank", type=int, default=-1)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == args.fail_rank:
    raise RuntimeError(f"rank {rank} fails on purpose")
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)  # the other ranks wait here when one fails
result = {
    "rank": rank,
    "world_size": dist.get_world_size(),
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "sum": value.item(),
}
Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
"""


def _options(**overrides: object) -> dict[str, object]:
    options: dict[str, object] = {
        "nproc": 2,
        "nnodes": "1",
        "node_rank": 0,
        "master_addr": "127.0.0.1",
        "master_port": 29500,
        "rdzv_endpoint": "",
    }
    return {**options, **overrides}


def _z_launch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Z), "launch", *args], capture_output=True, text=True, timeout=180, check=False
    )


def test_single_node_uses_static_rendezvous_on_master_port() -> None:
    argv = build_argv("train.py", ["--lr", "3"], **_options(master_port=29611))
    parsed = torchrun_parse_args(argv)
    assert parsed.nproc_per_node == "2"
    assert parsed.nnodes == "1"
    assert parsed.rdzv_backend == "static"
    assert (parsed.master_addr, parsed.master_port, parsed.node_rank) == ("127.0.0.1", 29611, 0)
    # Every rank runs the script through the entry that ties it to the launcher.
    assert parsed.module is True
    assert parsed.training_script == RANK_ENTRY
    assert parsed.training_script_args == ["train.py", "--lr", "3"]


def test_master_port_zero_picks_a_free_port() -> None:
    parsed = torchrun_parse_args(build_argv("train.py", [], **_options(master_port=0)))
    assert parsed.standalone is True


def test_rdzv_endpoint_uses_c10d_and_allows_elastic_nodes() -> None:
    options = _options(nnodes="2:4", node_rank=3, rdzv_endpoint="node0:29400")
    parsed = torchrun_parse_args(build_argv("train.py", [], **options))
    assert (parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.nnodes) == (
        "c10d",
        "node0:29400",
        "2:4",
    )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"nnodes": "1:4"},
            r"elastic `--nnodes 1:4` needs a c10d rendezvous: add `--rdzv-endpoint",
        ),
        ({"nnodes": "2", "node_rank": 2}, r"`--node-rank 2` must be below `--nnodes 2`"),
        ({"nnodes": "two"}, r"`--nnodes two` is not N or MIN:MAX"),
        ({"nnodes": "2", "master_port": 0}, r"works on one node only"),
    ],
)
def test_invalid_options_are_rejected_with_the_values(overrides: dict, match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        build_argv("train.py", [], **_options(**overrides))


def test_two_ranks_all_reduce_through_z_launch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    run = _z_launch(
        "--nproc", "2", "--master-port", str(free_port()), str(script), "--out", str(out)
    )
    assert run.returncode == 0, run.stderr
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, result in enumerate(results):
        assert result == {"rank": rank, "world_size": 2, "local_rank": rank, "sum": 3.0}


def test_failing_rank_fails_the_launch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = str(free_port())
    run = _z_launch(
        "--nproc",
        "2",
        "--master-port",
        port,
        str(script),
        "--out",
        str(tmp_path),
        "--fail-rank",
        "1",
    )
    assert run.returncode == 1
    assert "rank 1 fails on purpose" in run.stderr
    # Rank 0 may fail too (its peer left mid all_reduce) or be stopped by torchrun.
    assert re.search(rf"error: ranks? (0, )?1 of `{re.escape(str(script))}` failed \(", run.stderr)
    assert not list(tmp_path.glob("rank*.json"))


def test_missing_script_is_exit_2_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "train.py"
    run = _z_launch("--nproc", "2", str(missing))
    assert run.returncode == 2
    assert str(missing) in run.stderr
    assert "not found" in run.stderr


LOOP = """\
import os, sys, time
from pathlib import Path

Path(sys.argv[1], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_die_with_a_killed_launcher(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    argv = [str(Z), "launch", "--nproc", "2", "--master-port", str(free_port())]
    launcher = subprocess.Popen(
        [*argv, str(script), str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        files = [tmp_path / f"rank{rank}.pid" for rank in range(2)]
        deadline = time.monotonic() + 120
        while not all(f.is_file() and f.read_text() for f in files):
            assert launcher.poll() is None, "the launcher exited before both ranks started"
            assert time.monotonic() < deadline, "ranks did not start in 120 s"
            time.sleep(0.1)
        pids = [int(f.read_text()) for f in files]
        assert all(alive(pid) for pid in pids)
    finally:
        launcher.send_signal(signal.SIGKILL)  # the launcher process alone, not its group
        launcher.wait(timeout=10)
    assert still_alive_after(pids, 10) == []


def _rank_entry(script: Path, launcher: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", RANK_ENTRY, str(script), "--flag", "x"],
        env={**os.environ, LAUNCHER_PID: str(launcher)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_rank_entry_runs_the_script_as_python_would(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import json, sys\nprint(json.dumps([__name__, sys.argv, sys.path[0]]))\n")
    ran = _rank_entry(script, launcher=os.getpid())
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == ["__main__", [str(script), "--flag", "x"], str(tmp_path)]


def test_rank_entry_exits_when_the_launcher_is_already_gone(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    gone = _rank_entry(script, launcher=1)  # not this child's parent: its launcher died
    assert gone.returncode == 1
    assert "launcher (pid 1) is gone" in gone.stderr
    assert "ran" not in gone.stdout
