"""The reduce-scatter gradient reducer on real gloo ranks: a parameter larger than a
bucket goes in a bucket of its own, and the parameters after it reduce correctly.

(The engine all-reduces on gloo, where that is faster, so this path is otherwise run
only with NCCL.)"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.utils.distributed import run_ranks
from zcore.comm import Comm
from zcore.zero.layout import ParamShard, own_slot
from zcore.zero.reducer import GradReducer

NUMELS = {"small0": 5, "big": 41, "small1": 6, "small2": 3}  # big > 8-element buckets


def _shards(world: int) -> list[ParamShard]:
    out, offset = [], 0
    for name, numel in NUMELS.items():
        size = -(-numel // world)
        out.append(ParamShard(name, (numel,), numel, size, offset))
        offset += size
    return out


def _grad(name: str, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + len(name) * 7 + NUMELS[name])
    return torch.randn(NUMELS[name], generator=g)


def _reduce(rank: int, world: int) -> dict[str, torch.Tensor]:
    comm = Comm(dist.group.WORLD, rank, world, timeout_s=30)
    got: dict[str, torch.Tensor] = {}

    def accumulate(group: int, shard: ParamShard, values: torch.Tensor, alpha: float) -> None:
        assert shard.name not in got, f"{shard.name} reduced twice"
        got[shard.name] = values.clone() * alpha

    reducer = GradReducer(
        comm,
        accumulate,
        shard_world=world,
        bucket_elems=8,
        overlap=False,
        comm_dtype=None,
        predivide=1.0,
        reduce_scatter=True,
    )
    for shard in _shards(world):
        reducer.add(0, shard, _grad(shard.name, rank))
    reducer.finish()
    return got


def test_parameters_after_an_oversized_one_reduce_scatter_correctly() -> None:
    world = 2
    results = run_ranks(_reduce, world, timeout=120)
    for rank, got in enumerate(results):
        assert sorted(got) == sorted(NUMELS)
        for shard in _shards(world):
            total = sum(_grad(shard.name, r) for r in range(world))
            want = own_slot(total, shard, rank)
            torch.testing.assert_close(got[shard.name], want, rtol=1e-6, atol=1e-6)
