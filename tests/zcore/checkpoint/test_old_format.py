"""Checkpoints in the formats written before rank files were keyed by mesh coordinates load
and continue exactly.

A checkpoint is saved by today's code on 2 gloo ranks, then rewritten into each older
format: (1) the manifest's ``files`` give only the data-parallel coordinate (``{"dp": k}``,
the file named by data rank); (2) no ``files``, no ``axes`` and rank files without
``"groups"`` (the layout the manifest cuts every group by). A fresh engine loads each and
trains on: its losses and parameters equal the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, full_params, make_model, train


def _old_files(path: Path) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {name: {"dp": c["dp"]} for name, c in manifest["files"].items()}
    (path / "manifest.json").write_text(json.dumps(manifest))


def _oldest(path: Path) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    for key in ("files", "axes", "mesh"):
        manifest.pop(key)
    (path / "manifest.json").write_text(json.dumps(manifest))
    for file in path.glob("rank_*.pt"):
        shard = torch.load(file, weights_only=False)
        del shard["groups"]
        torch.save(shard, file)


def _resume(rank: int, world: int, root: str, stage: int) -> dict:
    import torch.distributed as dist

    cfg = config(stage)
    engine, *_ = zcore.initialize(make_model(), config=cfg)
    train(engine, 3)
    engine.save_checkpoint(root, tag="new")
    straight = train(engine, 3, start=3)
    ref = full_params(engine)
    engine.destroy()
    out = {}
    for tag, rewrite in (("files", _old_files), ("oldest", _oldest)):
        if rank == 0:
            shutil.copytree(Path(root) / "new", Path(root) / tag)
            rewrite(Path(root) / tag)
        dist.barrier()
        resumed, *_ = zcore.initialize(make_model(seed=5), config=cfg)
        resumed.load_checkpoint(root, tag=tag)
        again = train(resumed, 3, start=3)
        got = full_params(resumed)
        out[tag] = (again == straight, all(torch.equal(got[k], ref[k]) for k in ref))
        resumed.destroy()
    return out


@pytest.mark.parametrize(
    "stage", [2, pytest.param(3, marks=pytest.mark.slow(reason="stage 2 covers the same load"))]
)
def test_older_manifests_load_and_continue_exactly(stage: int, tmp_path: Path) -> None:
    for got in run_ranks(_resume, 2, args=(str(tmp_path), stage)):
        assert got == {"files": (True, True), "oldest": (True, True)}, got
