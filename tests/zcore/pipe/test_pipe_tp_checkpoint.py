"""A pp2 x tp2 engine's checkpoint: saved after 3 steps, loaded by fresh engines at the same
layout, the run continues with the uninterrupted run's losses (fp32, 1e-6 absolute); the
manifest carries every stage's tensor-parallel cuts under the plain GPT's names
(``PipeGPT.checkpoint_names``), so ``consolidate`` gives the full tensors of a ``GPT``
(equal to the gathered model's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.tensor.common import GPT_SHAPE, global_batch
from tests.zcore.zero.common import config
from zcore.checkpoint import consolidate
from zcore.tensor import gather_full_state_dict
from ztrain.gpt import GPTConfig
from ztrain.gpt_pipe import build_pipe_gpt, gpt_name

MB, GAS = 2, 2


def _engine(seed: int) -> Any:
    model = build_pipe_gpt(GPTConfig(**GPT_SHAPE), 2, seed=seed)
    extra = {"pipeline": {"schedule": "1f1b"}, "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = zcore.initialize(model, config=config(2, mb=MB, gas=GAS, clip=0.05, **extra))
    return engine


def _steps(engine: Any, start: int, n: int) -> list[float]:
    out = []
    for step in range(start, start + n):
        x, y = global_batch(step, MB * GAS)
        out.append(float(engine.train_batch(iter((x[r : r + MB], y[r : r + MB]) for r in (0, 2)))))
    return out


def _run(rank: int, world: int, path: str) -> tuple[list[float], list[float], dict]:
    engine = _engine(0)
    _steps(engine, 0, 3)
    engine.save_checkpoint(path, tag="step3")
    full = {gpt_name(k, 2): v for k, v in gather_full_state_dict(engine.module).items()}
    straight = _steps(engine, 3, 3)
    engine.destroy()
    resumed = _engine(7)
    resumed.load_checkpoint(path, tag="step3")
    assert resumed.global_steps == 3
    return straight, _steps(resumed, 3, 3), full


@pytest.mark.slow(reason="4 ranks, two engines each")
def test_pp2_tp2_checkpoint_resumes_and_consolidates(tmp_path: Path) -> None:
    outs = run_ranks(_run, 4, args=(str(tmp_path),), timeout=240)
    full: dict[str, torch.Tensor] = {}
    for straight, resumed, mine in outs:
        assert resumed == pytest.approx(straight, abs=1e-6)
        full.update(mine)
    merged = consolidate(str(tmp_path), "step3")
    assert set(merged) - {"lm_head.weight"} == set(full)  # the tie's second name
    for name, value in full.items():
        torch.testing.assert_close(merged[name].float(), value.float(), rtol=0, atol=0, msg=name)
