"""Byte accounting: every collective of a `Comm` charges what this rank sends, split by node.

Real gloo ranks with `LOCAL_WORLD_SIZE=2`, so 4 ranks are two "nodes" {0, 1} and {2, 3}:
each rank has one intra-node peer and two inter-node peers. Every expected number is
written out from the model in `zcore.comm.accounting`'s docstring.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.utils.distributed import run_ranks
from zcore.comm.accounting import OP_KINDS, Ledger, Traffic, TrafficTally
from zcore.comm.mesh import Mesh, MeshSpec

F32 = 4


def _mesh(world: int, dp: int | None = None) -> Mesh:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    return Mesh.build(MeshSpec.resolve(world, dp=dp), 30.0)


def _delta(comm: Any, fn: Any) -> dict[str, tuple[int, int]]:
    """(intra, inter) per op kind that `fn()` added to `comm.traffic`, nonzero kinds only."""
    before = {k: Traffic(t.intra, t.inter) for k, t in comm.traffic.items()}
    fn()
    out = {}
    for k, t in comm.traffic.items():
        d = t - before[k]
        if d.total:
            out[k] = (d.intra, d.inter)
    return out


def _every_op(rank: int, world: int) -> dict[str, Any]:
    mesh = _mesh(world)
    comm = mesh.comm("dp")
    got: dict[str, Any] = {}
    got["all_gather"] = _delta(
        comm, lambda: comm.all_gather(torch.zeros(10 * world), torch.ones(10), "ag").wait()
    )
    got["reduce_scatter"] = _delta(
        comm, lambda: comm.reduce_scatter(torch.zeros(2), torch.ones(2 * world), "rs").wait()
    )
    even = torch.ones(8)
    got["all_reduce_even"] = _delta(comm, lambda: comm.all_reduce(even, "ar").wait())
    assert even.tolist() == [float(world)] * 8
    got["all_reduce_uneven"] = _delta(comm, lambda: comm.all_reduce(torch.ones(10), "ar").wait())
    got["all_reduce_bf16"] = _delta(
        comm, lambda: comm.all_reduce(torch.ones(8, dtype=torch.bfloat16), "ar").wait()
    )
    # uneven all-to-all: rank r sends r + 1 + p rows of 3 fp32 values to rank p
    ins = [rank + 1 + p for p in range(world)]
    outs = [s + 1 + rank for s in range(world)]
    inp = torch.full((sum(ins), 3), float(rank))
    out = torch.empty(sum(outs), 3)
    got["all_to_all_uneven"] = _delta(
        comm, lambda: comm.all_to_all_single(out, inp, outs, ins, "a2a").wait()
    )
    assert out[:, 0].tolist() == [float(s) for s in range(world) for _ in range(outs[s])]
    got["all_to_all_even"] = _delta(
        comm,
        lambda: comm.all_to_all_single(
            torch.empty(world * 2, 5), torch.ones(world * 2, 5), None, None, "a2a"
        ).wait(),
    )
    t = torch.full((4,), float(rank))
    got["broadcast"] = _delta(comm, lambda: comm.broadcast(t, 1, "bc").wait())
    assert t.tolist() == [1.0] * 4
    got["max_flag"] = _delta(comm, lambda: comm.max_flag(rank == 0, "flag"))
    got["sum_scalar"] = _delta(comm, lambda: comm.sum_scalar(1.0, "sum"))
    got["barrier"] = _delta(comm, lambda: comm.barrier("barrier"))
    got["tally"] = mesh.traffic().as_dict()
    got["node_size"] = mesh.node_size
    return got


@pytest.mark.slow
def test_every_op_on_two_nodes_of_two() -> None:
    r = run_ranks(_every_op, 4)
    assert [x["node_size"] for x in r] == [2] * 4
    for got in r:
        # one intra-node peer, two inter-node peers
        assert got["all_gather"] == {"all_gather": (40, 80)}
        assert got["reduce_scatter"] == {"reduce_scatter": (8, 16)}  # chunk of 2 fp32
        # 8 fp32: chunk 2 elements to each peer, then this rank's reduced chunk to each
        assert got["all_reduce_even"] == {"all_reduce": (16, 32)}
        assert got["all_reduce_bf16"] == {"all_reduce": (8, 16)}
        assert got["all_to_all_even"] == {"all_to_all": (2 * 5 * F32, 2 * 2 * 5 * F32)}
    # 10 fp32 over 4: chunks 3, 3, 2, 2; peer p gets chunk p, then this rank's own chunk
    assert r[0]["all_reduce_uneven"] == {"all_reduce": (24, 40)}  # 1: 12+12; 2, 3: 8+12
    assert r[1]["all_reduce_uneven"] == {"all_reduce": (24, 40)}
    assert r[2]["all_reduce_uneven"] == {"all_reduce": (16, 40)}  # 3: 8+8; 0, 1: 12+8
    assert r[3]["all_reduce_uneven"] == {"all_reduce": (16, 40)}
    # rank r sends r + 1 + p rows of 12 bytes to peer p
    row = 3 * F32
    assert r[0]["all_to_all_uneven"] == {"all_to_all": (2 * row, (3 + 4) * row)}
    assert r[1]["all_to_all_uneven"] == {"all_to_all": (2 * row, (4 + 5) * row)}
    assert r[2]["all_to_all_uneven"] == {"all_to_all": (6 * row, (3 + 4) * row)}
    assert r[3]["all_to_all_uneven"] == {"all_to_all": (6 * row, (4 + 5) * row)}
    # broadcast from group rank 1: only it sends, 16 bytes to each peer
    assert [x["broadcast"] for x in r] == [{}, {"broadcast": (16, 32)}, {}, {}]
    # one-element all-reduces: chunk 0 is rank 0's, so the others send it theirs and rank 0
    # sends the result to all: max_flag/barrier fp32, sum_scalar fp64
    assert r[0]["max_flag"] == {"all_reduce": (4, 8)}
    assert r[1]["max_flag"] == {"all_reduce": (4, 0)}
    assert r[2]["max_flag"] == r[3]["max_flag"] == {"all_reduce": (0, 4)}
    assert r[0]["sum_scalar"] == {"all_reduce": (8, 16)}
    assert r[2]["barrier"] == {"all_reduce": (0, 4)}
    # the mesh's tally is the sum of everything above (its only comm here is `dp`)
    tally = r[0]["tally"]
    assert tally["all_gather"] == {"intra": 40, "inter": 80, "total": 120}
    assert tally["broadcast"]["total"] == 0
    assert set(tally) == {*OP_KINDS, "total"}
    assert tally["total"]["total"] == sum(tally[k]["total"] for k in OP_KINDS)


def _on_two(rank: int, world: int) -> dict[str, Any]:
    comm = _mesh(world).comm("dp")
    got = {
        "all_gather": _delta(
            comm, lambda: comm.all_gather(torch.zeros(6 * world), torch.ones(6), "ag").wait()
        ),
        "all_reduce": _delta(comm, lambda: comm.all_reduce(torch.ones(7), "ar").wait()),
        "reduce_scatter": _delta(
            comm, lambda: comm.reduce_scatter(torch.zeros(3), torch.ones(6), "rs").wait()
        ),
    }
    return got


def test_two_ranks_on_one_node_are_all_intra() -> None:
    # LOCAL_WORLD_SIZE=2 on 2 ranks: one node, so nothing is inter-node
    r = run_ranks(_on_two, 2)
    assert [x["all_gather"] for x in r] == [{"all_gather": (24, 0)}] * 2
    assert [x["reduce_scatter"] for x in r] == [{"reduce_scatter": (12, 0)}] * 2
    # 7 fp32 over 2: chunks 4, 3
    assert r[0]["all_reduce"] == {"all_reduce": (3 * F32 + 4 * F32, 0)}
    assert r[1]["all_reduce"] == {"all_reduce": (4 * F32 + 3 * F32, 0)}


def _sub_axes(rank: int, world: int) -> dict[str, Any]:
    # dp 2 x dp_replicate 2: dp groups {0,1},{2,3} (one node each); replicas {0,2},{1,3}
    mesh = _mesh(world, dp=2)
    x = torch.ones(4)
    dp = _delta(mesh.comm("dp"), lambda: mesh.comm("dp").all_gather(torch.zeros(8), x, "ag").wait())
    rep = mesh.comm("dp_replicate")
    across = _delta(rep, lambda: rep.all_gather(torch.zeros(8), x, "ag").wait())
    return {"dp": dp, "replicas": across, "total": mesh.traffic().total.as_dict()}


@pytest.mark.slow
def test_sub_axis_groups_place_peers_by_global_rank() -> None:
    for got in run_ranks(_sub_axes, 4):
        assert got["dp"] == {"all_gather": (16, 0)}
        assert got["replicas"] == {"all_gather": (0, 16)}
        assert got["total"] == {"intra": 16, "inter": 16, "total": 32}


def _compressed(rank: int, world: int, n: int) -> dict[str, Any]:
    # zcomm's compressed all-reduce through a zcore Comm: what it hands to its two
    # collectives is what the accounting charges
    from zcomm.compressed import CompressedAllReduce

    comm = _mesh(world).comm("dp")
    reducer = CompressedAllReduce(comm)
    torch.manual_seed(rank)
    got = _delta(comm, lambda: reducer(torch.randn(n)))
    wire = reducer.last_bytes
    return {"got": got, "phase1": wire.phase1, "phase2": wire.phase2}


@pytest.mark.slow
def test_compressed_all_reduce_is_charged_what_it_sends() -> None:
    world, n = 4, 1000
    for got in run_ranks(_compressed, world, args=(n,)):
        p1, p2 = got["phase1"], got["phase2"]
        # padded 1024 elements: chunk 256 -> 32 sign bytes + 4-byte scale per row
        assert (p1, p2) == (4 * 36, 36)
        a2a, ag = got["got"]["all_to_all"], got["got"]["all_gather"]
        assert sum(a2a) == p1 * (world - 1) // world  # its own row stays
        assert sum(ag) == p2 * (world - 1)
        assert a2a == (36, 72) and ag == (36, 72)


def test_ledger_single_process_and_bad_input() -> None:
    ledger = Ledger([0, 1, 2, 3, 4, 5], 4, node_size=3)  # nodes {0,1,2} {3,4,5}
    assert (ledger.n_intra, ledger.n_inter) == (2, 3)
    ledger.all_to_all(110, 11, [1, 0, 2, 0, 5, 3])  # 10-byte rows; its own 5 rows stay
    assert ledger.ops["all_to_all"] == Traffic(30, 30)
    ledger.broadcast(8, src=0)  # not the source: nothing
    assert ledger.ops["broadcast"] == Traffic()
    with pytest.raises(ValueError, match="node_size must be a positive integer, got 0"):
        Ledger([0, 1], 0, 0)
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2 ranks"):
        Ledger([0, 1], 2, 1)
    # a single process: collectives are no-ops and nothing is charged
    single = Mesh.build(None, 5.0) if not dist.is_initialized() else None
    if single is not None:
        comm = single.comm("dp")
        comm.all_reduce(torch.ones(3), "ar").wait()
        assert single.traffic().total == Traffic()


def test_tally_delta() -> None:
    before = TrafficTally()
    now = TrafficTally()
    now.add({"all_gather": Traffic(5, 7), "all_reduce": Traffic(1, 0)})
    step = now.minus(before)
    assert step.total == Traffic(6, 7)
    assert step.as_dict()["all_gather"] == {"intra": 5, "inter": 7, "total": 12}


def _engine_steps(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    import zcore

    os.environ.pop("LOCAL_WORLD_SIZE", None)  # one node: everything intra-node
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16, bias=False)  # 256 fp32 parameters
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "job"},
    }
    engine, *_ = zcore.initialize(model, config=cfg)
    steps = []
    for _ in range(2):
        before = engine.mesh.traffic()
        for _ in range(2):  # two micro-steps per optimizer step
            x = torch.randn(2, 16)
            engine.backward(engine(x).square().mean())
            engine.step()
        measured = engine.mesh.traffic().minus(before)
        assert engine.comm_traffic_last_step() == measured
        steps.append(engine.comm_traffic_last_step().as_dict())
    engine.destroy()
    return {"steps": steps, "last": engine.comm_bytes_last_step().as_dict()}


def test_engine_reports_bytes_per_step(tmp_path: Any) -> None:
    import csv

    r = run_ranks(_engine_steps, 2, args=(str(tmp_path),))
    for got in r:
        for step in got["steps"]:
            # stage 2 reduces the 256 gradients (1 KiB) on each of the 2 micro-steps: an
            # all-reduce on gloo sends half to the peer and its reduced half back, 1 KiB
            # each; scalars (the gradient norm) add a few bytes; then the updated half of
            # the weights is gathered
            assert 2 * 1024 <= step["all_reduce"]["total"] < 2 * 1024 + 64, step
            assert step["all_gather"] == {"intra": 512, "inter": 0, "total": 512}
            assert step["total"]["inter"] == 0
        assert got["steps"][0] == got["steps"][1]
        assert got["last"] == got["steps"][1]["total"]
    with open(tmp_path / "job" / "Train_Samples_comm_bytes_intra.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "Train/Samples/comm_bytes_intra"]
    assert [float(v) for _, v in rows[1:]] == [r[0]["last"]["intra"]] * 2
