"""Sharded checkpoints: resume on another world size, atomic saves, consolidation."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import baseline, config, full_params, make_model, train
from zcore.checkpoint import CheckpointError, consolidate

GLOBAL = 8  # samples per step: micro 2 x accumulation 2 x world 2 (or micro 1 x 2 x 4 …)


def _cfg(stage: int, world: int) -> dict:
    return config(stage, mb=GLOBAL // (2 * world), gas=2)


def _save(rank: int, world: int, stage: int, ckpt: str) -> list[float]:
    engine, *_ = zcore.initialize(make_model(), config=_cfg(stage, world))
    losses = train(engine, 5)
    engine.save_checkpoint(ckpt, client_state={"epoch": 3, "note": "half way"})
    return losses


def _resume(rank: int, world: int, stage: int, ckpt: str) -> tuple[list[float], dict, dict]:
    engine, *_ = zcore.initialize(make_model(seed=123), config=_cfg(stage, world))
    _, client = engine.load_checkpoint(ckpt)
    assert engine.global_steps == 5
    losses = train(engine, 5, start=5)
    return losses, client, full_params(engine)


@pytest.mark.parametrize(("stage", "before", "after"), [(2, 2, 4), (3, 4, 1), (1, 2, 1), (0, 2, 4)])
def test_resume_on_another_world_size_equals_uninterrupted(
    tmp_path: Path, stage: int, before: int, after: int
) -> None:
    ckpt = str(tmp_path / "ckpt")
    first = run_ranks(_save, before, args=(stage, ckpt))
    if after == 1:
        second = [_resume_single(stage, ckpt)]
    else:
        second = run_ranks(_resume, after, args=(stage, ckpt))
    ref_losses, ref_params = baseline(10, global_size=GLOBAL)
    assert first[0] == pytest.approx(ref_losses[:5], abs=2e-5)
    for losses, client, params in second:
        assert client == {"epoch": 3, "note": "half way"}
        assert losses == pytest.approx(ref_losses[5:], abs=2e-5)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, atol=1e-4, rtol=0, msg=name)


def _resume_single(stage: int, ckpt: str) -> tuple[list[float], dict, dict]:
    # world size 1 without torch.distributed: a plain single process
    return _resume(0, 1, stage, ckpt)


def test_consolidate_gives_a_plain_state_dict(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_save, 2, args=(3, ckpt))
    sd = consolidate(ckpt)
    model = make_model(seed=7)
    model.load_state_dict(sd, strict=True)  # tied head.weight included
    _, ref_params = baseline(5, global_size=GLOBAL)
    for name, ref in ref_params.items():
        torch.testing.assert_close(model.state_dict()[name], ref, atol=1e-4, rtol=0, msg=name)


def _failing_save(rank: int, world: int, ckpt: str) -> dict:
    import zcore.checkpoint.sharded as sharded

    engine, *_ = zcore.initialize(make_model(), config=_cfg(2, 2))
    train(engine, 2)
    engine.save_checkpoint(ckpt, tag="good")
    before = full_params(engine)
    train(engine, 1, start=2)
    real = sharded.save_torch

    def disk_full(obj: object, path: Path) -> None:
        if engine.rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(obj, path)

    sharded.save_torch = disk_full
    try:
        engine.save_checkpoint(ckpt, tag="bad")
    except CheckpointError as err:
        message = str(err)
    else:
        message = ""
    finally:
        sharded.save_torch = real
    engine.load_checkpoint(ckpt)  # `latest` still names the good one
    after = full_params(engine)
    same = all(torch.equal(before[k], after[k]) for k in before)
    return {"message": message, "same": same, "steps": engine.global_steps}


def test_failed_save_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    results = run_ranks(_failing_save, 2, args=(str(ckpt),))
    for r in results:
        assert "No space left on device" in r["message"] or "another rank" in r["message"]
        assert "intact" in results[1]["message"]
        assert r["same"] and r["steps"] == 2
    assert (ckpt / "latest").read_text() == "good"
    assert sorted(p.name for p in ckpt.iterdir()) == ["good", "latest"]


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no `latest` file"):
        consolidate(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"manifest\.json"):
        consolidate(str(tmp_path), tag="nope")
