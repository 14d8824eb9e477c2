"""`z train` with a curriculum, in-process on one rank: the legacy sequence-length schedule
cuts the batches, the data-efficiency sampler draws only admitted windows, and a run
resumed from a mid-run checkpoint trains on the same sample ids with the same losses as
the uninterrupted run, exactly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ztrain.train_options import TrainError, TrainOptions
from ztrain.train_plan import plan_run
from ztrain.trainer import Trainer

STEPS, SEQ = 4, 32


def _config(tmp: Path) -> dict[str, Any]:
    return {
        "curriculum_learning": {
            "enabled": True,
            "curriculum_type": "seqlen",
            "min_difficulty": 8,
            "max_difficulty": SEQ,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": 3, "difficulty_step": 8},
        },
        "data_efficiency": {
            "enabled": True,
            "seed": 5,
            "data_sampling": {
                "enabled": True,
                "curriculum_learning": {
                    "enabled": True,
                    "curriculum_metrics": {
                        "vocab_rarity": {
                            "index_to_sample_path": str(tmp / "idx" / "r_index_to_sample.pt"),
                            "index_to_metric_path": str(tmp / "idx" / "r_index_to_metric.pt"),
                            "difficulty_type": "percentile",
                            "min_difficulty": 10,
                            "max_difficulty": 100,
                            "schedule_type": "fixed_discrete",
                            "schedule_config": {"difficulty": [10, 50, 100], "max_step": [1, 2]},
                        }
                    },
                },
            },
        },
    }


def _run(opts: TrainOptions) -> tuple[list[torch.Tensor], list[float], list[int]]:
    """Train on one rank in this process, saving half way and at the end; the sample ids,
    losses and seqlens of each step."""
    t = Trainer.start(plan_run(opts, 1))
    ids, losses, seqlens = [], [], []
    try:
        for step in range(t.engine.global_steps, STEPS):
            losses.append(t.train_step(step))
            ids.append(t.curriculum._ids.clone())
            seqlens.append(t.curriculum.last_seqlen)
            if step + 1 == STEPS // 2:
                t.save()
        t.save()
    finally:
        t.engine.destroy()
    return ids, losses, seqlens


@pytest.fixture
def opts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TrainOptions:
    monkeypatch.setenv("ZSTACK_CACHE", str(Path.home() / ".cache" / "zstack" / "shakespeare"))
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_config(tmp_path)))
    return TrainOptions(
        out=tmp_path / "a",
        preset="tiny",
        steps=STEPS,
        stage=1,
        config=config,
        micro_batch=2,
        grad_accum=2,
        seq_len=SEQ,
        vocab_size=2048,
    )


def test_resumed_curriculum_run_equals_the_uninterrupted_one(opts: TrainOptions) -> None:
    ids, losses, seqlens = _run(opts)
    # fixed_linear 8 -> 32 over 3 steps: 8 + 24 s / 3 rounded down to multiples of 8
    assert seqlens == [16, 24, 32, 32]
    # fixed_discrete percentiles 10, 50, 100 of the windows sorted by vocabulary rarity
    order = torch.load(opts.out.parent / "idx" / "r_index_to_sample.pt").long()
    n = len(order)
    for step, allowed in ((0, (n // 100) * 10), (1, (n // 100) * 50), (3, n)):
        assert set(ids[step].tolist()) <= set(order[:allowed].tolist())
    # resume from the half-way checkpoint
    (opts.checkpoints / "latest").write_text(f"global_step{STEPS // 2}")
    ids_b, losses_b, _ = _run(dataclasses.replace(opts, resume=True))
    for a, b in zip(ids[STEPS // 2 :], ids_b, strict=True):
        assert torch.equal(a, b)
    assert losses_b == losses[STEPS // 2 :]  # bit-identical


def test_seqlen_curriculum_longer_than_the_windows_is_refused(opts: TrainOptions) -> None:
    config = json.loads(opts.config.read_text())
    config["curriculum_learning"]["max_difficulty"] = 64
    opts.config.write_text(json.dumps(config))
    with pytest.raises(TrainError, match=r"max_difficulty 64 exceeds `--seq-len 32`"):
        plan_run(opts, 1)
