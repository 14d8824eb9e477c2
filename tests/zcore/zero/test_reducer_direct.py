"""One rank in the ZeRO group (dp 1: pure tensor or pipeline parallelism): the gradient
reducer accumulates each gradient straight into the partition, with no bucket copy and no
collective, and the run is bit-identical to the bucketed path."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.tensor.common import global_batch, make_gpt
from tests.zcore.zero.common import config
from zcore.comm import Comm, MeshSpec
from zcore.tensor import gather_full_state_dict, parallelize
from zcore.zero.layout import ParamShard
from zcore.zero.reducer import GradReducer


def _reducer(comm: Comm, got: dict[str, torch.Tensor], **kw: Any) -> GradReducer:
    def accumulate(group: int, shard: ParamShard, values: torch.Tensor, alpha: float) -> None:
        got[shard.name] = values.clone() * alpha

    base = dict(shard_world=1, bucket_elems=8, overlap=False, comm_dtype=None, predivide=1.0)
    return GradReducer(comm, accumulate, **{**base, **kw})


def _unit(rank: int, world: int) -> dict[str, bool]:
    comm = Comm(dist.group.WORLD, rank, world, timeout_s=30)
    grad = torch.randn(5, 3, generator=torch.Generator().manual_seed(7))
    shard = ParamShard("w", (5, 3), 15, 15, 0)
    out: dict[str, bool] = {}
    for name, kw in {
        "direct": {},
        "bf16 wire": {"comm_dtype": torch.bfloat16},
        "predivide": {"predivide": 2.0},
    }.items():
        got: dict[str, torch.Tensor] = {}
        reducer = _reducer(comm, got, **kw)
        reducer.add(0, shard, grad)
        no_bucket = reducer._bucket is None and not reducer._pooled
        reducer.finish()
        out[name] = no_bucket
        if name == "direct":
            out["same"] = torch.equal(got["w"], grad.reshape(-1))
    return out


def test_one_rank_group_accumulates_without_a_bucket() -> None:
    (out,) = run_ranks(_unit, 1)
    assert out["direct"] and out["same"]
    # a cast on the wire or a predivide changes the values: those keep the bucket
    assert not out["bf16 wire"] and not out["predivide"]


def _train(rank: int, world: int, stage: int) -> dict[str, Any]:
    runs = []
    for direct in (True, False):
        spec = MeshSpec.resolve(world, tp=world)
        model = parallelize(make_gpt(), spec)
        engine, *_ = zcore.initialize(model, config=config(stage, mb=2, gas=2), mesh=spec)
        reducers = list(engine.zopt.reducers.values())
        taken = all(r.direct for r in reducers)
        for r in reducers:
            r.direct = direct
        losses = []
        for step in range(3):
            for micro in range(2):
                x, y = global_batch(10 * step + micro, 2)
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
        params = gather_full_state_dict(engine.module)
        runs.append({"taken": taken, "losses": losses, "params": params})
        engine.destroy()
    return {"runs": runs}


def test_tp2_dp1_direct_reduction_is_bit_identical() -> None:
    for rank, out in enumerate(run_ranks(_train, 2, args=(2,))):
        direct, bucketed = out["runs"]
        assert direct["taken"], rank  # dp 1: every reducer takes the direct path
        assert direct["losses"] == bucketed["losses"], rank
        for k, v in bucketed["params"].items():
            assert torch.equal(direct["params"][k], v), (rank, k)
