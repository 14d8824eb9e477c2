"""The shared-memory collectives of tensor-parallel serving (`zserve.tp.shm`) on 2 and 3 real
processes (a gloo group for the set-up), against a plain sum of every rank's tensor.

Exact: the shared-memory sum is taken in rank order on every rank, so each rank's result is
bit-identical to ``((x_0 + x_1) + x_2)`` computed locally, and at 2 ranks to gloo's. Slots of
4 KiB make the (16, 576) tensors go in pieces. A peer that exits ends the waiting rank's
collective with a TPRankError naming it within seconds (not at the timeout); a peer that
stops answering, at the timeout. Rank 0's step commands reach every rank through the
segment's command slot (over the control group when too large, or without a segment), and a
rank waiting for one waits past the timeout, until rank 0 exits.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.utils.distributed import run_ranks
from zserve.tp import shm
from zserve.tp.group import TPGroup, TPRankError

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs /dev/shm on x86-64")

SLOT = 4096
SHAPES = [(1, 576), (16, 576), (3, 5)]


def _inputs(world: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input, the same on every rank (a seed from the shape)."""
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(world)]


def _segments(pid: int) -> list[str]:
    return [f for f in os.listdir(shm.SHM_DIR) if f.startswith(f"zserve-tp-{pid}-")]


def _reduce_and_gather(rank: int, world: int) -> dict[str, object]:
    if world == 3:  # the waits spin on as on an idle host, whatever this one's load
        shm.cpus_crowded = lambda: False  # type: ignore[assignment]
    coll = shm.ShmCollectives.open(rank, world, 10.0, slot_bytes=SLOT)
    assert coll is not None
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())
    left = _segments(pids[0])  # unlinked once every rank mapped it
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            xs = _inputs(world, shape, dtype)
            want = xs[0] + xs[1]
            for x in xs[2:]:
                want = want + x
            got = xs[rank].clone()
            coll.all_reduce(got)
            assert torch.equal(got, want), (shape, dtype)
            if world == 2 and dtype == torch.float32:  # two terms commute: gloo's bits
                by_gloo = xs[rank].clone()
                dist.all_reduce(by_gloo)
                assert torch.equal(got, by_gloo), (shape, dtype)
            stacked = coll.all_gather(xs[rank])
            assert stacked is not None and torch.equal(stacked, torch.stack(xs))
            assert (coll.all_gather(xs[rank], keep=rank == 0) is None) == (rank != 0)
    # in place on a non-contiguous view (its columns), a piece-wise one included
    xs = _inputs(world, (576, 16), torch.float32)
    got = xs[rank].clone().t()
    coll.all_reduce(got)
    assert torch.allclose(got, sum(xs).t(), atol=1e-5)
    coll.close()
    return {"left": left, "seq": coll.seq}


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_and_gather_equal_a_plain_sum(world: int) -> None:
    outs = run_ranks(_reduce_and_gather, world, timeout=60)
    assert all(o["left"] == [] for o in outs), "the segment was left under /dev/shm"
    assert len({o["seq"] for o in outs}) == 1


def _group(rank: int, world: int, timeout_s: float) -> TPGroup:
    coll = shm.ShmCollectives.open(rank, world, timeout_s, slot_bytes=SLOT)
    assert coll is not None
    g = dist.group.WORLD
    assert g is not None
    return TPGroup(rank, world, g, g, timeout_s, shm=coll)


def _peer_exits(rank: int, world: int) -> float:
    group = _group(rank, world, timeout_s=60.0)
    group.all_reduce(torch.ones(576))
    if rank == 1:
        return 0.0  # this rank's process ends
    group.begin_step()
    start = time.monotonic()
    with pytest.raises(TPRankError, match=r"all_reduce after layer 0 .*rank 1 \(pid \d+\) exited"):
        group.all_reduce(torch.ones(576))
    return time.monotonic() - start


def test_a_peer_that_exits_is_named_at_once() -> None:
    waited = run_ranks(_peer_exits, 2, timeout=60)[0]
    assert waited < 10, f"rank 0 waited {waited:.1f} s for a dead peer (timeout 60 s)"


def _peer_stalls(rank: int, world: int) -> float:
    group = _group(rank, world, timeout_s=0.5)
    group.all_reduce(torch.ones(576))
    if rank == 1:
        time.sleep(3.0)  # then its next collective finds rank 0's data already there
        group.all_reduce(torch.ones(576))
        return 0.0
    start = time.monotonic()
    with pytest.raises(TPRankError, match=r"rank 1 did not reach .* within 0.5 s"):
        group.all_reduce(torch.ones(576))
    return time.monotonic() - start


def test_a_stalled_peer_times_out_naming_it() -> None:
    waited = run_ranks(_peer_stalls, 2, timeout=60)[0]
    assert 0.5 <= waited < 3.0


def test_a_bad_slot_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"slot_bytes 1000 must be a positive multiple of 4096"):
        shm.ShmCollectives.open(0, 2, 1.0, slot_bytes=1000)


def _commands(rank: int, world: int) -> list[list[int]]:
    """Rank 0's commands, through the shared-memory slot and (a payload past it, or no
    segment at all) over the control group; back to back, and with a collective between."""
    big = torch.arange(shm.CMD_BYTES // 8, dtype=torch.int64)  # past the slot with its header
    sent = [(1, torch.arange(7)), (1, torch.empty(0, dtype=torch.int64)), (2, big), (1, big[:3])]
    seen: list[list[int]] = []
    g = dist.group.WORLD
    assert g is not None
    for group in (_group(rank, world, timeout_s=30.0), TPGroup(rank, world, g, g, 30.0)):
        for i, (kind, payload) in enumerate(sent):
            if rank == 0:
                for work in group.post(kind, payload):
                    work.wait()
            else:
                got_kind, got = group.receive()
                assert got_kind == kind and torch.equal(got, payload), (i, group.collectives)
                seen.append([got_kind, got.numel()])
            if i % 2:
                group.all_reduce(torch.ones(4))
    return seen


def test_commands_reach_every_rank() -> None:
    outs = run_ranks(_commands, 3, timeout=60)
    assert outs[1] == outs[2] == [[1, 7], [1, 0], [2, shm.CMD_BYTES // 8], [1, 3]] * 2


def _rank0_exits(rank: int, world: int) -> float:
    group = _group(rank, world, timeout_s=0.5)  # an idle wait outlives the timeout
    if rank == 0:
        group.post(1, torch.arange(3))
        time.sleep(1.5)
        return 0.0  # this rank's process ends
    assert group.receive()[0] == 1
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 \(pid \d+\) exited while rank 1 waited"):
        group.receive()
    return time.monotonic() - start


def test_a_rank_waiting_for_commands_outlives_the_timeout_not_rank_0() -> None:
    waited = run_ranks(_rank0_exits, 2, timeout=60)[1]
    assert 1.0 <= waited < 10, f"rank 1 waited {waited:.1f} s for its next command"
