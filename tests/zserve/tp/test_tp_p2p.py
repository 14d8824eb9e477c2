"""The point-to-point collectives of tensor-parallel serving (`zserve.tp.p2p`) on 2 and 3 real
gloo processes, against a plain sum of every rank's tensor.

Exact: the sum is taken in rank order on every rank, so each rank's result is bit-identical
to ``((x_0 + x_1) + x_2)`` computed locally (fp32 and bf16, odd sizes, a strided view summed
in place), and at 2 ranks to gloo's ``all_reduce``. The gathers equal a stack of every rank's
tensor (on every rank, or on rank 0 only). Rank 0's step commands reach every rank, in the
command message and past it. A peer that exits ends the other's collective with a
TPRankError naming the op within seconds (not at the timeout); a peer that stops answering,
at the group's timeout. gloo's transport threads run under SCHED_BATCH at nice 19 once
quieted.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.utils.distributed import run_ranks
from zserve.tp.group import TRANSPORT_THREAD, TPGroup, TPRankError, quiet_transport_threads
from zserve.tp.p2p import CMD_WORDS, P2PCollectives

SHAPES = [(1, 576), (16, 576), (3, 5), (1, 1)]


def _inputs(world: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input, known on every rank (a seed from the shape)."""
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(world)]


def _group(rank: int, world: int, timeout_s: float) -> TPGroup:
    """A TPGroup over every rank whose compute group times out after ``timeout_s``."""
    compute = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(minutes=5))
    assert isinstance(compute, dist.ProcessGroup) and isinstance(control, dist.ProcessGroup)
    p2p = P2PCollectives(rank, world, compute, control)
    return TPGroup(rank, world, compute, control, timeout_s, p2p=p2p)


def _reduce_and_gather(rank: int, world: int) -> list[str]:
    coll = _group(rank, world, 30.0).p2p
    assert coll is not None
    checked = []
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            xs = _inputs(world, shape, dtype)
            want = xs[0] + xs[1]
            for x in xs[2:]:
                want = want + x
            for _ in range(2):  # the second time through the kept receive buffers
                got = xs[rank].clone()
                coll.all_reduce(got)
                assert torch.equal(got, want), (shape, dtype)
            if world == 2:
                by_gloo = xs[rank].clone()
                dist.all_reduce(by_gloo)
                assert torch.equal(got, by_gloo), (shape, dtype)
            stacked = coll.all_gather(xs[rank])
            assert stacked is not None and torch.equal(stacked, torch.stack(xs))
            to_first = coll.all_gather(xs[rank], everyone=False)
            if rank == 0:
                assert to_first is not None and torch.equal(to_first, torch.stack(xs))
            else:
                assert to_first is None
            checked.append(f"{shape}:{dtype}")
    # in place on a non-contiguous view (a transpose), and a gather of one
    xs = _inputs(world, (576, 16), torch.float32)
    base = xs[rank].clone()
    view = base.t()
    coll.all_reduce(view)
    assert torch.allclose(base, sum(xs), atol=1e-5)
    stacked = coll.all_gather(xs[rank].t())
    assert stacked is not None and torch.equal(stacked, torch.stack([x.t() for x in xs]))
    return checked


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_and_gather_equal_a_plain_sum(world: int) -> None:
    outs = run_ranks(_reduce_and_gather, world, timeout=60)
    assert len(outs[0]) == 2 * len(SHAPES) and all(o == outs[0] for o in outs)


def _commands(rank: int, world: int) -> list[list[int]]:
    """Rank 0's commands, in the command message and past it, back to back and with a
    collective between, over point-to-point sends and over broadcasts."""
    big = torch.arange(CMD_WORDS, dtype=torch.int64)  # past the message with its header
    sent = [(1, torch.arange(7)), (1, torch.empty(0, dtype=torch.int64)), (2, big), (1, big[:3])]
    seen: list[list[int]] = []
    p2p = _group(rank, world, 30.0)
    plain = TPGroup(rank, world, p2p.compute, p2p.control, 30.0)
    for group in (p2p, plain):
        for i, (kind, payload) in enumerate(sent):
            if rank == 0:
                for work in group.post(kind, payload):
                    work.wait()
            else:
                got_kind, got = group.receive()
                assert got_kind == kind and torch.equal(got, payload), (i, group.collectives)
                seen.append([got_kind, got.numel()])
                if i in (0, 2):  # the next command's receive posted ahead, as a worker does
                    group.expect_command()
            if i % 2:
                group.all_reduce(torch.ones(4))
    return seen


def test_commands_reach_every_rank() -> None:
    """Inline, empty and two-message commands, into receives posted when called and ahead."""
    outs = run_ranks(_commands, 3, timeout=60)
    assert outs[1] == outs[2] == [[1, 7], [1, 0], [2, CMD_WORDS], [1, 3]] * 2


def _peer_exits(rank: int, world: int) -> float:
    group = _group(rank, world, timeout_s=60.0)
    group.all_reduce(torch.ones(576))
    if rank == 1:
        return 0.0  # this rank's process ends
    group.begin_step()
    start = time.monotonic()
    with pytest.raises(TPRankError, match=r"all_reduce after layer 0 \(attention\) of step 1"):
        group.all_reduce(torch.ones(576))
    return time.monotonic() - start


def test_a_peer_that_exits_is_named_at_once() -> None:
    waited = run_ranks(_peer_exits, 2, timeout=60)[0]
    assert waited < 10, f"rank 0 waited {waited:.1f} s for a dead peer (timeout 60 s)"


def _peer_stalls(rank: int, world: int) -> float:
    group = _group(rank, world, timeout_s=0.5)
    group.all_reduce(torch.ones(576))
    if rank == 1:
        time.sleep(3.0)
        try:  # rank 0 gave up on it meanwhile
            group.all_reduce(torch.ones(576))
        except RuntimeError:
            pass
        return 0.0
    start = time.monotonic()
    with pytest.raises(TPRankError, match=r"all_reduce after layer 0"):
        group.all_reduce(torch.ones(576))
    return time.monotonic() - start


def test_a_stalled_peer_times_out_naming_the_op() -> None:
    waited = run_ranks(_peer_stalls, 2, timeout=60)[0]
    assert 0.4 <= waited < 3.0, waited


def test_a_group_of_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank 0 of 1: a group of >= 2 ranks"):
        P2PCollectives(0, 1, None, None)  # type: ignore[arg-type]


def _quieted(rank: int, world: int) -> list[tuple[int, int]]:
    _group(rank, world, 30.0)
    changed = quiet_transport_threads()
    seen = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == TRANSPORT_THREAD:
                tid_ = int(tid)
                seen.append((os.sched_getscheduler(tid_), os.getpriority(os.PRIO_PROCESS, tid_)))
    assert changed == len(seen) >= 2  # the default group's and the two new groups' threads
    return seen


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_transport_threads_run_batch_at_nice_19() -> None:
    for seen in run_ranks(_quieted, 2, timeout=60):
        assert seen and all(s == (os.SCHED_BATCH, 19) for s in seen), seen
