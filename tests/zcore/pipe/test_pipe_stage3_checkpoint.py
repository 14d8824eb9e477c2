"""A ZeRO-3 pipeline checkpoint loads at another layout and continues the run.

The pipeline tests' layer stack (tied embedding, 4 blocks) trains at ZeRO-3 with
(pp, tp, dp) = (2, 1, 2), or (2, 1, 1) in the default case, saves after ``SAVE_AT`` steps
and trains on to ``STEPS`` (the uninterrupted run). Fresh engines (another seed) load the
checkpoint at (1, 1, 1) and back at the saving layout, train the same steps and save: their
losses equal the uninterrupted run's within 1e-5 relative and ``consolidate`` of their end
checkpoints agrees with the uninterrupted run's within 2e-5 absolute
(tests/zcore/checkpoint/common.py's tolerances). ``save_16bit_model`` at pp2 writes one file
holding every stage's layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.checkpoint.common import LOSS_RTOL, PARAM_ATOL, SAVE_AT, STEPS, WARMUP
from tests.zcore.checkpoint.test_recut_pp import GAS, ROWS, pipe_steps
from tests.zcore.pipe.common import config, make_pipe
from zcore.checkpoint import consolidate
from zcore.tensor import gather_full_state_dict


def engine_at(world: int, pp: int, seed: int, stage: int = 3) -> Any:
    dp = world // pp
    cfg = config(stage, mb=ROWS // (GAS * dp), gas=GAS, scheduler=WARMUP)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    return zcore.initialize(make_pipe(pp, base_seed=seed), config=cfg)[0]


def _save(rank: int, world: int, pp: int, root: str) -> list[float]:
    engine = engine_at(world, pp, 1234)
    pipe_steps(engine, 0, SAVE_AT)
    engine.save_checkpoint(root, tag="a")
    straight = pipe_steps(engine, SAVE_AT, STEPS)
    engine.save_checkpoint(root, tag="end")
    engine.destroy()
    if dist.is_initialized():
        dist.barrier()
    return straight


def _load(rank: int, world: int, pp: int, stage: int, root: str, tag: str) -> list[float]:
    engine = engine_at(world, pp, 99, stage)
    engine.load_checkpoint(root, tag="a")
    assert engine.global_steps == SAVE_AT
    losses = pipe_steps(engine, SAVE_AT, STEPS)
    engine.save_checkpoint(root, tag=tag)
    engine.destroy()
    return losses


def _check(root: str, straight: list[float], tag: str, outs: list[list[float]]) -> None:
    for losses in outs:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(straight), rtol=LOSS_RTOL, atol=0
        )
    ref, got = consolidate(root, "end"), consolidate(root, tag)
    assert got.keys() == ref.keys(), tag
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_ATOL, msg=f"{tag} {name}")


def test_pp2_stage3_checkpoint_loads_at_one_process(tmp_path: Path) -> None:
    """(2, 1, 1) at ZeRO-3 -> (1, 1, 1) at ZeRO-3."""
    root = str(tmp_path)
    straight = run_ranks(_save, 2, args=(2, root))[0]
    _check(root, straight, "end-111", run_ranks(_load, 1, args=(1, 3, root, "end-111")))


@pytest.mark.slow(reason="4 ranks, four runs; the (2, 1, 1) case runs by default")
def test_pp2_dp2_stage3_checkpoint_loads_at_pp1_and_back_at_pp2_dp2(tmp_path: Path) -> None:
    """(2, 1, 2) at ZeRO-3 -> (1, 1, 1) at ZeRO-3 and ZeRO-1, and (2, 1, 2) at ZeRO-3."""
    root = str(tmp_path)
    straight = run_ranks(_save, 4, args=(2, root), timeout=240)[0]
    for stage in (3, 1):
        tag = f"end-111-stage{stage}"
        _check(root, straight, tag, run_ranks(_load, 1, args=(1, stage, root, tag)))
    outs = run_ranks(_load, 4, args=(2, 3, root, "end-212"), timeout=240)
    _check(root, straight, "end-212", outs)


def _save16(rank: int, world: int, stage: int, root: str) -> dict[str, torch.Tensor]:
    cfg = config(stage, mb=2, gas=GAS)
    cfg["zero_optimization"].update(
        stage3_param_persistence_threshold=100, stage3_gather_16bit_weights_on_model_save=True
    )
    engine = zcore.initialize(make_pipe(2), config=cfg)[0]
    pipe_steps(engine, 0, 1)
    engine.save_16bit_model(root)
    full = gather_full_state_dict(engine.module)
    engine.destroy()
    return full


@pytest.mark.parametrize("stage", [3, pytest.param(1, marks=pytest.mark.slow(reason="2 ranks"))])
def test_pp2_save_16bit_model_holds_every_stage(tmp_path: Path, stage: int) -> None:
    """One file with every stage's layers (a tie once), equal to each stage's gathered
    parameters after a step; no part files left."""
    outs = run_ranks(_save16, 2, args=(stage, str(tmp_path)))
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert saved.keys() == make_pipe(1).state_dict().keys()
    for full in outs:
        for name, value in full.items():
            torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pytorch_model.bin"]
