"""The multi-rank harness itself, on real gloo ranks: results, errors, skips, deaths, hangs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.utils.distributed import run_ranks


def _all_reduce_sum(rank: int, world_size: int, scale: float) -> list[float]:
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    assert os.environ["RANK"] == str(rank)
    tensor = torch.tensor([rank + 1.0, scale * rank])
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("bad shard size 7")
    dist.barrier()  # left hanging by rank 1: the harness must still report promptly
    return rank


def _skip_everywhere(rank: int, world_size: int) -> None:
    pytest.skip("needs 8 GPUs")


def _exit_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def _hang_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def _read_env(rank: int, world_size: int, name: str) -> str | None:
    return os.environ.get(name)


def _descendants() -> set[int]:
    """Pids below this process from /proc, zombies included (a zombie keeps its entry until
    reaped). Ranks are children of the fork server, so children alone would miss them."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_sum_reaches_every_rank(world_size: int) -> None:
    results = run_ranks(_all_reduce_sum, world_size, args=(10.0,), timeout=60)
    total = float(sum(range(1, world_size + 1)))
    scaled = 10.0 * sum(range(world_size))
    assert results == [[total, scaled]] * world_size


def test_ranks_see_the_callers_current_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ranks fork from a long-lived server, so the environment must be passed, not inherited.
    monkeypatch.setenv("ZSTACK_HARNESS_MARK", f"set-at-{time.monotonic()}")
    expected = os.environ["ZSTACK_HARNESS_MARK"]
    assert run_ranks(_read_env, 2, args=("ZSTACK_HARNESS_MARK",), timeout=60) == [expected] * 2


def test_rank_exception_names_rank_and_traceback() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_raise_on_rank_1, 2, timeout=60)
    message = str(info.value)
    # Rank 1 is named first, as the cause; rank 0 fails after it when its peer leaves.
    assert message.startswith("rank 1 of 2 raised:")
    assert "ValueError: bad shard size 7" in message
    assert "_raise_on_rank_1" in message  # the traceback, not only the message


def test_skip_in_rank_skips_the_test() -> None:
    with pytest.raises(pytest.skip.Exception, match="needs 8 GPUs"):
        run_ranks(_skip_everywhere, 2, timeout=60)


def test_rank_that_dies_reports_exit_code() -> None:
    with pytest.raises(AssertionError, match=r"rank 1 of 2 exited with exit code 3"):
        run_ranks(_exit_on_rank_1, 2, timeout=60)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_timeout_names_hung_rank_and_leaves_no_process() -> None:
    # Start the fork server (long-lived by design) before taking the baseline.
    run_ranks(_all_reduce_sum, 2, args=(1.0,), timeout=60)
    before = _descendants()
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_hang_on_rank_0, 2, timeout=5)
    assert time.monotonic() - start < 5 + 2 * 5 + 5  # timeout, terminate/kill waits, slack
    assert str(info.value).startswith("ranks [0] of 2 did not finish within 5")
    assert "finished: [1]" in str(info.value)
    assert _descendants() <= before


def test_a_taken_rendezvous_port_starts_the_ranks_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """free_port's port can be taken before rank 0 binds it (another job's connection): the
    ranks start again on a new port instead of failing the test with EADDRINUSE."""
    import socket

    from zcore import process, ranks

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports = iter([held.getsockname()[1]])
        monkeypatch.setattr(ranks, "free_port", lambda: next(ports, None) or process.free_port())
        assert run_ranks(_all_reduce_sum, 2, args=(2.0,)) == [[3.0, 2.0], [3.0, 2.0]]
        assert next(ports, None) is None  # the taken port was handed out, then a new one
