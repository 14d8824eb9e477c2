"""CPU gradient buckets are capped at ``CPU_BUCKET_ELEMS`` whatever ``reduce_bucket_size``
asks, so an idle model-sized bucket does not stay resident through the optimizer step; the
capped run is bit-identical to one model-sized bucket (2 ranks: each sum is a + b)."""

from __future__ import annotations

from typing import Any

import torch

import zcore
import zcore.zero.optimizer as zopt
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, full_params, make_model, train


def _run(rank: int, world: int, stage: int) -> dict[str, Any]:
    runs = {}
    for cap in (1 << 40, 512):
        zopt.CPU_BUCKET_ELEMS = cap  # this rank's own process: read when the engine is built
        cfg = config(stage, zero_optimization={"reduce_bucket_size": 10**9})
        engine, *_ = zcore.initialize(make_model(), config=cfg)
        capacity = max(r.capacity for r in engine.zopt.reducers.values())
        losses = train(engine, 3)
        runs[cap] = {"capacity": capacity, "losses": losses, "params": full_params(engine)}
        engine.destroy()
    return runs


def test_capped_cpu_buckets_are_bit_identical() -> None:
    for stage in (2, 3):
        for rank, runs in enumerate(run_ranks(_run, 2, args=(stage,))):
            whole, capped = runs[1 << 40], runs[512]
            assert capped["capacity"] <= 512 < whole["capacity"], (stage, rank)
            assert capped["losses"] == whole["losses"], (stage, rank)
            for k, v in whole["params"].items():
                assert torch.equal(capped["params"][k], v), (stage, rank, k)
