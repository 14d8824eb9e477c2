"""fp16 dynamic loss scaling: an overflow on one rank skips the step on every rank."""

from __future__ import annotations

import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, full_params, make_model, train


def _overflow(rank: int, world: int, stage: int) -> dict:
    cfg = config(stage, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, *_ = zcore.initialize(make_model(), config=cfg)
    train(engine, 2)
    before = full_params(engine)
    scale = engine.loss_scale

    def poison(step: int, micro: int, loss: torch.Tensor) -> torch.Tensor:
        # only rank 1 overflows, and only in one micro-batch of step 2
        if engine.rank == 1 and micro == 1:
            return loss * float("inf")
        return loss

    train(engine, 1, start=2, fail=poison)
    after = full_params(engine)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    train(engine, 1, start=3)
    moved = not all(torch.equal(after[k], v) for k, v in full_params(engine).items())
    return {
        "unchanged": unchanged,
        "moved_after": moved,
        "skipped": engine.skipped_steps,
        "scale_before": scale,
        "scale_after": engine.loss_scale,
        "steps": engine.global_steps,
    }


def test_overflow_skips_step_on_every_rank() -> None:
    for stage in (1, 3):
        for r in run_ranks(_overflow, 2, args=(stage,)):
            assert r["unchanged"], f"stage {stage}: an overflowing step changed the weights"
            assert r["moved_after"], f"stage {stage}: training did not resume after the skip"
            assert r["skipped"] == 1
            assert r["scale_after"] == r["scale_before"] / 2
            assert r["steps"] == 4
