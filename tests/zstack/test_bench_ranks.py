"""`benchmarks/_ranks.launch`, the one way a multi-rank benchmark starts its ranks: each rank a
fresh process of the benchmark's file with its spec and the `env://` rendezvous variables,
results back in rank order; a failed or stuck rank fails the launch with its exit code and
the end of its log. The ranks here are plain Python (no torch), so each case takes a
fraction of a second."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from zcore.bench import load

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_ranks = load("_ranks", BENCHMARKS)

SCRIPT = f"""
import os, sys, time
from zcore.bench import load

_ranks = load("_ranks", {str(BENCHMARKS)!r})
spec = _ranks.rank_spec(sys.argv)
env = {{k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                   "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ZSTACK_LAUNCHER_PID")}}
print("rank", spec["rank"], "says hello")
if spec.get("fail") == spec["rank"]:
    sys.exit(3)
if spec.get("sleep"):
    time.sleep(spec["sleep"])
if spec.get("shm"):  # what DeepSpeed's CPU shm all-reduce leaves behind, named by the port
    name = "deepspeed_allreduce_buffer_%d_127.0.0.1_%d_0" % (spec["rank"], spec["port"])
    open("/dev/shm/" + name, "w").close()
_ranks.write_result(spec, {{"spec": spec, "env": env, "extra": os.environ.get("EXTRA")}})
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "rank_script.py"
    path.write_text(SCRIPT)
    return path


def test_every_rank_gets_its_spec_and_rendezvous_and_results_come_back_in_order(
    script: Path, tmp_path: Path
) -> None:
    got = _ranks.launch(
        script,
        3,
        {"size": 7},
        tmp_path,
        timeout_s=60,
        what="test",
        port=12345,
        per_rank=lambda r: ([], {"EXTRA": f"x{r}"}),
    )
    assert [g["spec"]["rank"] for g in got] == [0, 1, 2]
    for rank, g in enumerate(got):
        assert g["spec"]["size"] == 7 and g["spec"]["world"] == 3 and g["spec"]["port"] == 12345
        assert g["env"] == {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "12345",
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "3",
            "ZSTACK_LAUNCHER_PID": str(os.getpid()),
        }
        assert g["extra"] == f"x{rank}"
    json.dumps(got)  # JSON-ready


def test_a_failed_rank_fails_the_launch_with_its_code_and_log(script: Path, tmp_path: Path) -> None:
    with pytest.raises(
        RuntimeError,
        match=r"(?s)bench x: the 2 ranks failed \(exit codes "
        r"\[0, 3\]\).*rank 1 .*rank 1 says hello",
    ):
        _ranks.launch(script, 2, {"fail": 1}, tmp_path, timeout_s=60, what="bench x")


def test_a_stuck_rank_is_killed_at_the_timeout(script: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"timed out after 2 s"):
        _ranks.launch(script, 2, {"sleep": 60}, tmp_path, timeout_s=2, what="bench y")


def test_a_rank_command_line_is_recognised() -> None:
    assert _ranks.rank_spec(["zero.py", "--preset", "small"]) is None


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this system")
def test_the_peers_shared_memory_for_this_port_is_removed(script: Path, tmp_path: Path) -> None:
    other = Path("/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_1_0")  # another launch's
    other.write_text("")
    try:
        got = _ranks.launch(script, 2, {"shm": True}, tmp_path, timeout_s=60, what="test")
        port = got[0]["spec"]["port"]
        assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
        assert other.exists()
    finally:
        other.unlink(missing_ok=True)
