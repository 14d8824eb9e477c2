"""A tp 2 run saves and resumes at the same layout with the uninterrupted run's losses.

Tensor-parallel shards form groups of their own with no mirrors, so every ``tp`` coordinate
writes its own rank file; the replicated parameters are written once (tp coordinate 0).
A fresh engine (another seed) loading the checkpoint must continue bit for bit, and
``consolidate`` must give the full parameters at the save, one tensor per name, the tp
shards reassembled. An engine at tp 1 x dp 2 loads it too, with the full parameters at the
save (the runs that continue at another tp: ``tests/zcore/checkpoint/test_recut_tp.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.tensor.common import GPT_SHAPE, global_batch
from tests.zcore.zero.common import config
from zcore.checkpoint import consolidate
from zcore.comm import MeshSpec
from zcore.tensor import gather_full_state_dict, parallelize
from ztrain.gpt import GPT, GPTConfig

SAVE_AT, STEPS, MB = 2, 4, 2


def _steps(engine: zcore.ZEngine, start: int, end: int) -> list[float]:
    out = []
    for step in range(start, end):
        x, y = global_batch(step, MB)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(float(loss.detach()))
    return out


def _run(rank: int, world: int, stage: int, root: str) -> dict:
    spec = MeshSpec.resolve(world, tp=world)
    cfg = config(stage, mb=MB, gas=1)

    def engine(seed: int, spec: MeshSpec = spec) -> zcore.ZEngine:
        model = parallelize(GPT(GPTConfig(**GPT_SHAPE), seed=seed), spec)
        return zcore.initialize(model, config=cfg, mesh=spec)[0]

    first = engine(0)
    _steps(first, 0, SAVE_AT)
    first.save_checkpoint(root, tag="t")
    at_save = gather_full_state_dict(first.module)
    whole = consolidate(root, "t")  # no process group: tp shards reassembled from the files
    consolidated = whole.keys() == at_save.keys() and all(
        torch.equal(whole[k], v) for k, v in at_save.items()
    )
    after = _steps(first, SAVE_AT, STEPS)
    params = gather_full_state_dict(first.module)
    first.destroy()
    again = engine(5)
    again.load_checkpoint(root, tag="t")
    resumed = _steps(again, SAVE_AT, STEPS)
    same = all(torch.equal(v, params[k]) for k, v in gather_full_state_dict(again.module).items())
    again.destroy()
    other = engine(5, MeshSpec.resolve(world))  # tp 1, dp 2: re-cut on load
    other.load_checkpoint(root, tag="t")
    recut = gather_full_state_dict(other.module)
    other_tp = recut.keys() == at_save.keys() and all(
        torch.equal(recut[k], v) for k, v in at_save.items()
    )
    other.destroy()
    files = json.loads(Path(root, "t", "manifest.json").read_text())["files"]
    return {
        "after": after,
        "resumed": resumed,
        "same": same,
        "files": files,
        "other_tp": other_tp,
        "consolidated": consolidated,
    }


@pytest.mark.parametrize(
    "stage", [3, pytest.param(1, marks=pytest.mark.slow(reason="stage 3 covers the path"))]
)
def test_tp2_resumes_from_its_checkpoint(tmp_path: Path, stage: int) -> None:
    for out in run_ranks(_run, 2, args=(stage, str(tmp_path))):
        assert out["resumed"] == out["after"]
        assert out["same"]
        assert out["consolidated"]
        assert sorted(c["tp"] for c in out["files"].values()) == [0, 1], out["files"]
        assert out["other_tp"]
