"""`zcore.checkpoint.missing_files`: what a load of a real 2-rank checkpoint would miss."""

from __future__ import annotations

from pathlib import Path

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, make_model, train
from zcore.checkpoint import missing_files


def _save(rank: int, world: int, root: str) -> None:
    engine, *_ = zcore.initialize(make_model(), config=config(3, mb=2, gas=1))
    train(engine, 1)
    engine.save_checkpoint(root, tag="t")
    engine.destroy()


def test_missing_files_names_what_a_load_would_miss(tmp_path: Path) -> None:
    run_ranks(_save, 2, args=(str(tmp_path),))
    ckpt = tmp_path / "t"
    assert missing_files(ckpt) == []
    (ckpt / "rank_00001.pt").unlink()
    (ckpt / "common.pt").unlink()
    assert missing_files(ckpt) == ["rank_00001.pt", "common.pt"]
    (ckpt / "manifest.json").write_text('{"shard_world": 2')  # torn
    assert missing_files(ckpt) == ["manifest.json"]
    (ckpt / "manifest.json").unlink()
    assert missing_files(ckpt) == ["manifest.json"]
    assert missing_files(tmp_path / "never-saved") == ["manifest.json"]
