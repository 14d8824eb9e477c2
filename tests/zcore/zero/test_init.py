"""zero.Init builds a model already partitioned; GatheredParameters reads and edits it."""

from __future__ import annotations

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import baseline, config, full_params, make_model, train
from zcore.config import ConfigError
from zcore.zero import GatheredParameters, Init


def _init_then_train(rank: int, world: int) -> dict:
    with Init(persistence_threshold=30):
        model = make_model()
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    ref = make_model()
    with GatheredParameters(list(model.parameters())):
        pairs = zip(model.parameters(), ref.parameters(), strict=True)
        same_init = all(torch.equal(p, r) for p, r in pairs)
    engine, *_ = zcore.initialize(model, config=config(3))
    losses = train(engine, 10)
    return {"sizes": sizes, "same_init": same_init, "losses": losses, "params": full_params(engine)}


def test_init_partitions_at_construction_and_trains_like_the_baseline() -> None:
    results = run_ranks(_init_then_train, 2)
    ref_losses, ref_params = baseline(10, global_size=8)
    for r in results:
        # big parameters hold no data outside forward; small ones (<= 30 elements) persist
        assert r["sizes"]["blocks.0.fc.weight"] == 0
        assert r["sizes"]["emb.weight"] == 0
        assert r["sizes"]["blocks.0.ln.weight"] == 24
        assert r["same_init"]
        assert r["losses"] == pytest.approx(ref_losses, abs=2e-5)
        for name, ref in ref_params.items():
            torch.testing.assert_close(r["params"][name], ref, atol=1e-4, rtol=0, msg=name)


def _edit(rank: int, world: int, stage: int) -> dict:
    engine, *_ = zcore.initialize(make_model(), config=config(stage))
    weight = engine.module.blocks[0].fc.weight
    with GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            weight.data.fill_(0.25)
    with GatheredParameters([weight]):
        seen = weight.detach().clone()
    train(engine, 1)  # the edit reached the fp32 master weights: training starts from it
    params = full_params(engine)
    return {"seen": seen, "after": params["blocks.0.fc.weight"]}


@pytest.mark.parametrize("stage", [1, 3])
def test_gathered_parameters_edit_is_broadcast_and_kept(stage: int) -> None:
    for r in run_ranks(_edit, 2, args=(stage,)):
        assert torch.all(r["seen"] == 0.25)
        # one AdamW step at lr 3e-3 moves each weight by at most ~lr
        assert torch.allclose(r["after"], torch.full_like(r["after"], 0.25), atol=5e-3)


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"train_batch_size": 7}, "train_batch_size"),
        ({"zero_optimization": {"stage": 4}}, "stage"),
        ({"zero_optimization": {"reduce_bucket_size": -1}}, "reduce_bucket_size"),
        ({"zero_optimizaton": {}}, "did you mean zero_optimization"),
        ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "offload"),
        ({"flops_profiler": {"enabled": True}}, "flops_profiler"),
    ],
)
def test_bad_config_fails_at_initialize(patch: dict, needle: str) -> None:
    cfg = config(2)
    cfg.update(patch)
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=needle):
        zcore.initialize(model, config=cfg)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
