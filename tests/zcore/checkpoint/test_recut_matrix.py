"""The issue's layout matrix: ``z train``'s GPT saved at (pp, tp, dp) = (2, 2, 2) loads at
(1, 1, 4), (1, 2, 1), (2, 1, 2) and (1, 1, 1) and continues the uninterrupted run.

As ``z train`` runs it: at pp > 1 the pipelined GPT (:mod:`ztrain.gpt_pipe`, each stage's
layers cut over tp by ``tensor_parallel.autotp_size``) whose ``checkpoint_names()`` are the
plain GPT's (``PipeGPT``); at pp 1 the plain GPT, cut over tp by
:func:`zcore.tensor.parallelize`. ZeRO-1 (and again with every run at ZeRO-3), AdamW, a
warm-up schedule still rising at the save, no clipping. Every step reads the same 4
sequences at every layout (2 micro-batches per data rank through the pipeline, one batch per
data rank without), so the losses compare directly. The save run trains 2 steps, saves,
trains 2 more (the uninterrupted run) and saves again; each layout loads the first
checkpoint, trains the same 2 steps and saves: its losses equal the uninterrupted run's
within 1e-5 relative, and ``consolidate`` of its end checkpoint equals that of the
uninterrupted run's within 2e-5 absolute, one tensor per plain-GPT name, which
``GPT.load_state_dict`` takes with ``strict=True``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.checkpoint.common import (
    LOSS_RTOL,
    PARAM_ATOL,
    SAVE_AT,
    STEPS,
    WARMUP,
    mean_over_ranks,
)
from tests.zcore.tensor.common import GPT_SHAPE, global_batch
from tests.zcore.zero.common import config
from zcore.checkpoint import consolidate
from zcore.comm import MeshSpec
from zcore.tensor import parallelize
from ztrain.gpt import GPT, GPTConfig
from ztrain.gpt_pipe import build_pipe_gpt

ROWS, GAS = 4, 2
SHAPE = GPTConfig(**GPT_SHAPE)
SAVE = (2, 2, 2)
LOADS = [(1, 1, 4), (1, 2, 1), (2, 1, 2), (1, 1, 1)]


def _engine(pp: int, tp: int, dp: int, seed: int, stage: int = 1) -> Any:
    if pp > 1:
        model = build_pipe_gpt(SHAPE, pp, seed=seed)  # checkpoint_names(): GPT's names
        extra = {"pipeline": {"schedule": "1f1b"}, "tensor_parallel": {"autotp_size": tp}}
        cfg = config(stage, mb=ROWS // (GAS * dp), gas=GAS, clip=0.0, scheduler=WARMUP, **extra)
        return zcore.initialize(model, config=cfg)[0]
    spec = MeshSpec.resolve(pp * tp * dp, tp=tp)
    model = GPT(SHAPE, seed=seed)
    if tp > 1:
        model = parallelize(model, spec)
    cfg = config(stage, mb=ROWS // dp, gas=1, clip=0.0, scheduler=WARMUP)
    return zcore.initialize(model, config=cfg, mesh=spec)[0]


def _steps(engine: Any, pp: int, start: int, end: int) -> list[float]:
    dp, d = engine.world_size, engine.data_rank
    mine = ROWS // dp
    out = []
    for step in range(start, end):
        x, y = global_batch(step, ROWS)
        x, y = x[d * mine : (d + 1) * mine], y[d * mine : (d + 1) * mine]
        if pp > 1:
            mb = mine // GAS
            micro = [(x[i : i + mb], y[i : i + mb]) for i in range(0, mine, mb)]
            out.append(float(engine.train_batch(iter(micro))))
            continue
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(mean_over_ranks(float(loss.detach())))
    return out


def _save(rank: int, world: int, root: str, stage: int = 1) -> list[float]:
    engine = _engine(*SAVE, seed=0, stage=stage)
    _steps(engine, SAVE[0], 0, SAVE_AT)
    engine.save_checkpoint(root, tag="a")
    straight = _steps(engine, SAVE[0], SAVE_AT, STEPS)
    engine.save_checkpoint(root, tag="end")
    engine.destroy()
    return straight


def _load(
    rank: int, world: int, layout: tuple[int, int, int], root: str, stage: int = 1
) -> list[float]:
    engine = _engine(*layout, seed=5, stage=stage)
    engine.load_checkpoint(root, tag="a")
    assert engine.global_steps == SAVE_AT
    resumed = _steps(engine, layout[0], SAVE_AT, STEPS)
    engine.save_checkpoint(root, tag="end-{}-{}-{}".format(*layout))
    engine.destroy()
    return resumed


def _saved(factory: pytest.TempPathFactory, stage: int) -> tuple[str, list[float]]:
    root = str(factory.mktemp(f"matrix-stage{stage}"))
    straight = run_ranks(_save, 8, args=(root, stage), timeout=300)
    assert all(s == straight[0] for s in straight)
    return root, straight[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    return _saved(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def saved3(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    return _saved(tmp_path_factory, 3)


def _check(saved: tuple[str, list[float]], layout: tuple[int, int, int], stage: int) -> None:
    root, straight = saved
    world = layout[0] * layout[1] * layout[2]
    for resumed in run_ranks(_load, world, args=(layout, root, stage), timeout=300):
        torch.testing.assert_close(
            torch.tensor(resumed), torch.tensor(straight), rtol=LOSS_RTOL, atol=0
        )
    ref = consolidate(root, "end")
    got = consolidate(root, "end-{}-{}-{}".format(*layout))
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_ATOL, msg=name)
    plain = {**ref, "lm_head.weight": ref["transformer.wte.weight"]}
    GPT(SHAPE, seed=1).load_state_dict(plain, strict=True)  # one tensor per plain-GPT name


@pytest.mark.slow(reason="8 gloo ranks save at pp2 x tp2 x dp2, then 1-4 ranks load: minutes")
@pytest.mark.parametrize("layout", LOADS, ids=lambda lay: "pp{}-tp{}-dp{}".format(*lay))
def test_the_pp2_tp2_dp2_checkpoint_loads_at(
    saved: tuple[str, list[float]], layout: tuple[int, int, int]
) -> None:
    _check(saved, layout, 1)


@pytest.mark.slow(reason="8 gloo ranks save at pp2 x tp2 x dp2 at ZeRO-3, then 1-4 ranks load")
@pytest.mark.parametrize("layout", LOADS, ids=lambda lay: "pp{}-tp{}-dp{}".format(*lay))
def test_the_pp2_tp2_dp2_stage3_checkpoint_loads_at(
    saved3: tuple[str, list[float]], layout: tuple[int, int, int]
) -> None:
    """The same matrix with every run at ZeRO-3 (each stage's parameters cut over dp)."""
    _check(saved3, layout, 3)
