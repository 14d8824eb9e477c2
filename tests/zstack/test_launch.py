"""`z launch`: the torchrun argv it builds, and real 2-rank gloo runs through the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import parse_args as torchrun_parse_args

from tests.utils.distributed import free_port
from zstack.launch import LaunchError, build_argv

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
    assert parsed.training_script == "train.py"
    assert parsed.training_script_args == ["--lr", "3"]


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
