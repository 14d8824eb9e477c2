"""Checkpoints written before the parameter table still load, at their layout and another.

Before checkpoints re-cut across layouts, a manifest had no ``"params"`` table and rank
files no ``"param_groups"`` (a tensor-parallel manifest's ``"tp_cuts"`` named the cut
parameters). Checkpoints saved now and rewritten without both (:func:`strip`), on two gloo
ranks: the GPT at tp 2 loads at tp 2 and continues bit for bit, and at tp 1 x dp 2 within
the re-cut tolerance (:mod:`tests.zcore.checkpoint.common`); the pipeline stack at pp 2
loads at pp 2 bit for bit (at pp 1: :mod:`tests.zcore.checkpoint.test_recut_pp`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.utils.distributed import run_ranks
from tests.zcore.checkpoint.common import LOSS_RTOL, SAVE_AT, STEPS, gpt_engine, gpt_steps


def strip(root: Path, tag: str, to: str) -> None:
    """Copy checkpoint ``tag`` to ``to`` as the code before the table wrote it."""
    path = root / to
    shutil.copytree(root / tag, path)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["params"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    for file in path.glob("rank_*.pt"):
        shard = torch.load(file, weights_only=False)
        del shard["param_groups"]
        torch.save(shard, file)


def _resume(rank: int, world: int, root: str) -> dict[str, Any]:
    from tests.zcore.checkpoint.test_recut_pp import pipe_engine, pipe_steps

    out: dict[str, Any] = {}
    for kind, make, steps, layouts in (
        ("tp", lambda n, s: gpt_engine(world, n, 2, s), gpt_steps, (2, 1)),
        ("pp", lambda n, s: pipe_engine(world, n, s), pipe_steps, (2,)),
    ):
        first = make(2, 1234)
        steps(first, 0, SAVE_AT)
        first.save_checkpoint(root, tag=kind)
        straight = steps(first, SAVE_AT, STEPS)
        first.destroy()
        if rank == 0:
            strip(Path(root), kind, f"old-{kind}")
        dist.barrier()
        for n in layouts:
            again = make(n, 5)
            again.load_checkpoint(root, tag=f"old-{kind}")
            out[f"{kind}{n}"] = (straight, steps(again, SAVE_AT, STEPS))
            again.destroy()
    return out


def test_checkpoints_from_before_the_table_load(tmp_path: Path) -> None:
    for out in run_ranks(_resume, 2, args=(str(tmp_path),)):
        for same in ("tp2", "pp2"):
            straight, resumed = out[same]
            assert resumed == straight, same
        straight, resumed = out["tp1"]
        torch.testing.assert_close(
            torch.tensor(resumed), torch.tensor(straight), rtol=LOSS_RTOL, atol=0
        )
