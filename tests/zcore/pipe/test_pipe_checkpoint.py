"""A pipeline engine's checkpoint: saved at pp2, loaded by fresh engines at pp2, the run
continues with the uninterrupted run's losses (fp32, 1e-6 absolute)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.pipe.common import config, make_pipe, micro_batches

MB, GAS = 2, 2


def _steps(engine: object, start: int, n: int) -> list[float]:
    dp, d = engine.world_size, engine.data_rank  # type: ignore[attr-defined]
    return [
        float(engine.train_batch(iter(micro_batches(s, dp, MB, GAS)[d])))  # type: ignore[attr-defined]
        for s in range(start, start + n)
    ]


def _run(rank: int, world: int, path: str) -> tuple[list[float], list[float]]:
    cfg = config(2, mb=MB, gas=GAS)
    engine, *_ = zcore.initialize(make_pipe(2), config=cfg)
    _steps(engine, 0, 3)
    engine.save_checkpoint(path, tag="step3")
    straight = _steps(engine, 3, 3)
    engine.destroy()
    resumed, *_ = zcore.initialize(make_pipe(2, base_seed=99), config=cfg)
    resumed.load_checkpoint(path, tag="step3")
    assert resumed.global_steps == 3
    return straight, _steps(resumed, 3, 3)


def test_pp2_checkpoint_resumes_the_run(tmp_path: Path) -> None:
    for straight, resumed in run_ranks(_run, 2, args=(str(tmp_path),)):
        assert resumed == pytest.approx(straight, abs=1e-6)
    manifest = json.loads((tmp_path / "step3" / "manifest.json").read_text())
    assert sorted(c["pp"] for c in manifest["files"].values()) == [0, 1]
