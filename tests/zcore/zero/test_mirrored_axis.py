"""A mesh axis whose ranks mirror each other is touched by no reduction.

A ``tp`` axis cuts no parameter yet, so its ranks hold the same values, read the same data
(``engine.data_rank`` ignores ``tp``) and compute the same gradients: the gradient norm and
the overflow flag must sum over the data axes only, and a checkpoint must be written once
per data slot. Such a run must give the run without the axis bit for bit: per-micro-batch
losses, gradient norms, parameters, and after a save, load and resume. The default test
puts a 2-wide ``tp`` beside one data rank at stage 3 (2 ranks vs 1); the slow one beside
``dp`` 2 at stages 0, 2 and 3 (4 ranks vs 2), the same code path with a reduced ``dp``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, full_params, make_model, micro_batch
from zcore.comm import MeshSpec
from zcore.zero import GatheredParameters

STEPS, SAVE_AT = 4, 2


def _steps(engine: zcore.ZEngine, start: int, end: int) -> tuple[list[float], list[float]]:
    gas, mb = engine.batch.gradient_accumulation_steps, engine.batch.micro_batch_size
    losses, norms = [], []
    for step in range(start, end):
        for micro in range(gas):
            x, y = micro_batch(step, micro, engine.data_rank, engine.world_size, mb, gas)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def _modify_on_data_rank_0(engine: zcore.ZEngine) -> float:
    """``GatheredParameters(modifier_rank=0)``: data rank 0's edit (here its global rank)
    reaches every rank of its data axes, not the whole job."""
    p = engine.module.ln_f.bias
    with GatheredParameters([p], modifier_rank=0):
        if engine.data_rank == 0:
            p.data.fill_(float(engine.rank))
    with GatheredParameters([p]):
        return float(p.data[0])


def _run(rank: int, world: int, tp: int, stages: tuple[int, ...], root: str) -> dict:
    spec = MeshSpec.resolve(world, tp=tp)
    out = {}
    for stage in stages:
        cfg = config(stage)
        engine, *_ = zcore.initialize(make_model(), config=cfg, mesh=spec)
        assert engine.world_size == world // tp
        before = _steps(engine, 0, SAVE_AT)
        engine.save_checkpoint(f"{root}/s{stage}", tag="t")
        after = _steps(engine, SAVE_AT, STEPS)
        params = full_params(engine)
        engine.destroy()
        resumed, *_ = zcore.initialize(make_model(seed=7), config=cfg, mesh=spec)
        resumed.load_checkpoint(f"{root}/s{stage}", tag="t")
        again = _steps(resumed, SAVE_AT, STEPS)
        same = all(torch.equal(v, params[k]) for k, v in full_params(resumed).items())
        edited = _modify_on_data_rank_0(resumed)
        resumed.destroy()
        files = json.loads(Path(f"{root}/s{stage}/t/manifest.json").read_text())["files"]
        out[stage] = {
            "run": (before, after),
            "again": again,
            "same": same,
            "files": files,
            "params": params,
            "data_rank": resumed.data_rank,
            "edited": edited,
            "tp": resumed.mesh.coordinate("tp"),
        }
    return out


def _compare(stages: tuple[int, ...], world: int, tmp_path: Path) -> None:
    plain = run_ranks(_run, world, args=(1, stages, str(tmp_path / "plain")))
    mirrored = run_ranks(_run, 2 * world, args=(2, stages, str(tmp_path / "tp")))
    for stage in stages:
        for rank, got in enumerate(mirrored):
            ref = plain[got[stage]["data_rank"]][stage]
            mine = got[stage]
            assert mine["run"] == ref["run"], (stage, rank)  # losses and norms, bit for bit
            assert all(torch.equal(mine["params"][k], v) for k, v in ref["params"].items())
            assert mine["again"] == mine["run"][1], (stage, rank)
            assert mine["same"], (stage, rank)
            # the global rank of data rank 0 at this rank's tp coordinate (tp is innermost)
            assert mine["edited"] == float(mine["tp"]), (stage, rank)
            # one file per data slot (stage 0: one), written by tp coordinate 0, keyed by
            # full coordinates
            files = mine["files"]
            slots = world if stage >= 1 else 1
            assert sorted(c["tp"] for c in files.values()) == [0] * slots, files
            assert {"pp", "dp_replicate", "dp", "tp"} <= set(next(iter(files.values())))


def test_mirrored_tp_axis_changes_nothing(tmp_path: Path) -> None:
    _compare((3,), 1, tmp_path)


@pytest.mark.slow(reason="4 ranks; test_mirrored_tp_axis_changes_nothing covers the path on 2")
def test_mirrored_tp_axis_beside_dp_changes_nothing(tmp_path: Path) -> None:
    _compare((0, 2, 3), 2, tmp_path)
