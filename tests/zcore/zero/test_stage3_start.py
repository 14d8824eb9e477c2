"""Stage 3 starts every rank from rank 0's initial weights, as stages 0-2 do."""

from __future__ import annotations

import torch
from torch import nn

import zcore
from tests.utils.distributed import run_ranks
from zcore.zero import GatheredParameters


def _differently_seeded(rank: int, world: int, stage: int) -> bool:
    torch.manual_seed(0)
    rank0 = nn.Linear(8, 8, bias=False).weight.detach().clone()
    torch.manual_seed(rank)  # every rank initialises differently
    model = nn.Linear(8, 8, bias=False)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zcore.initialize(model, config=cfg)
    with GatheredParameters(list(engine.module.parameters())):
        return torch.equal(engine.module.weight.detach(), rank0)


def test_every_stage_starts_from_rank0_weights() -> None:
    for stage in (0, 3):
        assert run_ranks(_differently_seeded, 2, args=(stage,)) == [True, True], stage
