"""Tensor parallelism beside ZeRO: tp 2 x dp 2 trains as one process does, at every stage.

Four ranks: two data-parallel replicas of the GPT cut over two ``tp`` ranks each, ZeRO
partitioning both the replicated parameters and the tp shards over ``dp``. The baseline is
one process taking both data ranks' sequences in one micro-batch, so the mean of the two
data ranks' losses is its loss. Losses, clipped norms and gathered parameters must match
with the tolerances of tests/zcore/tensor/common.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.zcore.tensor.common import assert_same_run, make_gpt, train
from zcore.comm import MeshSpec

STEPS, MB = 10, 2


def _run(rank: int, world: int, tp: int, stages: tuple[int, ...]) -> dict:
    spec = MeshSpec.resolve(world, tp=tp)
    dp = world // tp
    mb = MB * 2 // dp  # one process takes both data ranks' sequences
    return {s: train(make_gpt(), spec, s, STEPS, mb=mb, dp=dp) for s in stages}


def _check(stages: tuple[int, ...]) -> None:
    (ref,) = run_ranks(_run, 1, args=(1, (0,)))
    got = run_ranks(_run, 4, args=(2, stages), timeout=240)
    for stage in stages:
        runs = [out[stage] for out in got]
        by_data = {r["data_rank"]: r["losses"] for r in runs}
        assert sorted(by_data) == [0, 1], by_data.keys()
        mean = (torch.tensor(by_data[0]) + torch.tensor(by_data[1])) / 2
        for rank, mine in enumerate(runs):
            assert mine["losses"] == by_data[mine["data_rank"]], (stage, rank)  # tp ranks agree
            assert_same_run({**mine, "losses": mean.tolist()}, ref[0], f"stage {stage} rank {rank}")


def test_tp2_dp2_stage3() -> None:
    _check((3,))


@pytest.mark.slow(reason="4 ranks x 3 stages; test_tp2_dp2_stage3 covers stage 3 by default")
def test_tp2_dp2_stages_0_1_2() -> None:
    _check((0, 1, 2))
