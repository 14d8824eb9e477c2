"""Editing frozen (``requires_grad=False``) parameters at stage 3 under GatheredParameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import baseline, config, full_params, make_model, train
from zcore.zero import GatheredParameters

FROZEN, TRAINABLE = "blocks.0.fc.weight", "blocks.1.fc.weight"


def _frozen_model() -> nn.Module:
    model = make_model()
    model.blocks[0].fc.requires_grad_(False)
    return model


def _edit(params: dict[str, nn.Parameter], rank: int) -> None:
    """Rank 0 writes the values that must win; other ranks write garbage."""
    with torch.no_grad():
        if rank == 0:
            params[FROZEN].copy_(
                torch.linspace(-0.3, 0.3, params[FROZEN].numel()).view_as(params[FROZEN])
            )
            params[TRAINABLE].mul_(-2.0)
        else:
            params[FROZEN].fill_(7.0)
            params[TRAINABLE].fill_(-7.0)


def _edit_frozen(rank: int, world: int) -> dict:
    engine, *_ = zcore.initialize(_frozen_model(), config=config(3))
    named = dict(engine.module.named_parameters())
    edited = [named[FROZEN], named[TRAINABLE]]
    with GatheredParameters(edited, modifier_rank=0):
        _edit(named, rank)
    released = [p.numel() == 0 for p in edited]
    with GatheredParameters(edited):
        seen = {n: named[n].detach().clone() for n in (FROZEN, TRAINABLE)}
    losses = train(engine, 2)
    return {"released": released, "seen": seen, "losses": losses, "params": full_params(engine)}


def test_frozen_and_trainable_edits_reach_every_rank_and_training() -> None:
    ref = _frozen_model()
    _edit(dict(ref.named_parameters()), 0)
    ref_losses, ref_params = baseline(2, global_size=8, model=ref)
    for r in run_ranks(_edit_frozen, 2):
        assert r["released"] == [True, True]
        for name in (FROZEN, TRAINABLE):
            torch.testing.assert_close(r["seen"][name], ref.state_dict()[name], atol=0, rtol=0)
        assert r["losses"] == pytest.approx(ref_losses, abs=2e-5)
        for name, value in ref_params.items():
            torch.testing.assert_close(r["params"][name], value, atol=1e-4, rtol=0, msg=name)
        # the frozen weight did not move
        torch.testing.assert_close(r["params"][FROZEN], ref.state_dict()[FROZEN], atol=0, rtol=0)


class _Refused(RuntimeError):
    pass


def _failing_repartition(rank: int, world: int) -> dict:
    engine, *_ = zcore.initialize(_frozen_model(), config=config(3))
    s3 = engine.stage3
    named = dict(engine.module.named_parameters())
    edited = [named[FROZEN], named[TRAINABLE]]

    def refuse(p: nn.Parameter) -> None:  # a listener that fails on the first edit
        raise _Refused("refused")

    s3.on_repartition.insert(0, refuse)
    with pytest.raises(_Refused), GatheredParameters(edited, modifier_rank=0):
        pass
    s3.on_repartition.remove(refuse)
    return {
        "status": [s3.params[p].status for p in edited],
        "empty": [p.numel() == 0 for p in edited],
        "live": s3.live_elems,
    }


def test_failed_exit_still_releases_the_gathered_parameters() -> None:
    for r in run_ranks(_failing_repartition, 2):
        assert r["status"] == ["released", "released"]
        assert r["empty"] == [True, True]
        assert r["live"] == 0
