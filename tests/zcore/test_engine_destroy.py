"""``engine.destroy()`` takes the engine off the model: no hooks left, nothing kept alive.

A gradient hook left behind would hold the old engine (its master weights and optimizer
state) forever and, when the same model is wrapped again, move every gradient into the
dead engine's reducer before the new engine sees it.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config, full_params, make_model, train

FIRST, AGAIN = 2, 3  # optimizer steps before destroy(), and with the second engine


def _engine_refs(engine: Any) -> tuple[weakref.ref, weakref.ref]:
    return weakref.ref(engine), weakref.ref(engine.zopt)


def _left_on_model(model: torch.nn.Module) -> list[str]:
    left = []
    for name, p in model.named_parameters():
        if p._post_accumulate_grad_hooks:
            left.append(f"{name}: post-accumulate-grad hook")
        if hasattr(p, "_z_on_edit"):
            left.append(f"{name}: _z_on_edit")
    return left


def _rewrap(rank: int, world: int, stage: int) -> dict[str, Any]:
    cfg = config(stage)
    model = make_model()
    first, *_ = zcore.initialize(model, config=cfg)
    train(first, FIRST)
    first.destroy()
    refs = _engine_refs(first)
    del first, _
    gc.collect()
    out: dict[str, Any] = {"alive": [r() is not None for r in refs], "left": _left_on_model(model)}

    # the same weights in a model that no engine has wrapped
    twin = make_model(seed=1)
    twin.load_state_dict(model.state_dict())

    again, *_ = zcore.initialize(model, config=cfg)
    out["losses"] = train(again, AGAIN, start=FIRST)
    out["params"] = full_params(again)
    again.destroy()

    fresh, *_ = zcore.initialize(twin, config=cfg)
    out["fresh_losses"] = train(fresh, AGAIN, start=FIRST)
    out["fresh_params"] = full_params(fresh)
    fresh.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_model_wrapped_again_after_destroy_trains_like_a_fresh_one(stage: int) -> None:
    for rank, got in enumerate(run_ranks(_rewrap, 2, args=(stage,))):
        # same ranks, same collectives, same order: the two runs are bit-identical
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(got["fresh_losses"]), atol=0, rtol=0
        )
        for name, value in got["fresh_params"].items():
            torch.testing.assert_close(got["params"][name], value, atol=0, rtol=0, msg=name)
        assert got["left"] == [], f"rank {rank}: destroy() left {got['left']}"
        assert got["alive"] == [False, False], (
            f"rank {rank}: [engine, zero optimizer] still referenced after destroy(): "
            f"{got['alive']}"
        )


def _destroy_stage3(rank: int, world: int) -> dict[str, Any]:
    model = make_model()
    engine, *_ = zcore.initialize(model, config=config(3))
    train(engine, FIRST)
    engine.destroy()
    refs = _engine_refs(engine)
    del engine, _
    gc.collect()
    return {"alive": [r() is not None for r in refs], "left": _left_on_model(model)}


def test_stage3_destroy_releases_the_engine() -> None:
    for rank, got in enumerate(run_ranks(_destroy_stage3, 2)):
        assert got["left"] == [], f"rank {rank}: destroy() left {got['left']}"
        assert got["alive"] == [False, False], (
            f"rank {rank}: [engine, zero optimizer] still referenced after destroy(): "
            f"{got['alive']}"
        )
