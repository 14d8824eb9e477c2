"""Random-LTD through the engine: the config attaches it and the engine moves its schedule;
with the full token count it equals the plain model exactly (one process and 2 gloo ranks
under ZeRO), the LayerToken schedule sets the learning rate from layer-tokens, and a layer
count that does not match the model fails at start naming the key."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import zcore
from tests.utils.distributed import run_ranks

T, VOCAB, LAYERS = 32, 61, 4


def _model() -> torch.nn.Module:
    from ztrain.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=LAYERS, n_head=2, n_embd=32, block_size=T))


def _config(
    stage: int,
    keep: int | None,
    mb: int = 4,
    layer_token_lr: bool = False,
    total_layer_num: int = LAYERS,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": stage},
    }
    if keep is not None:
        cfg["data_efficiency"] = {
            "enabled": True,
            "data_routing": {
                "enabled": True,
                "random_ltd": {
                    "enabled": True,
                    "total_layer_num": total_layer_num,
                    "random_ltd_layer_num": 2,
                    "random_ltd_layer_id": [1, 2],
                    "random_ltd_schedule": {
                        "min_value": keep,
                        "max_value": T,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"require_steps": 4, "seq_per_step": 8},
                    },
                    "layer_token_lr_schedule": {
                        "enabled": layer_token_lr,
                        "total_layer_tokens": 40_000,
                        "warmup_type": "linear",
                        "warmup_layer_tokens": 8_000,
                    },
                },
            },
        }
    return cfg


def _batch(step: int, micro: int, rank: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ids = torch.randint(0, VOCAB, (mb, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _train(engine: Any, steps: int, rank: int = 0, mb: int = 4) -> list[float]:
    losses = []
    for step in range(steps):
        for micro in range(2):
            _, loss = engine(*_batch(step, micro, rank, mb))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def _params(engine: Any) -> dict[str, torch.Tensor]:
    from zcore.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params, enabled=engine.stage == 3):
        return {n: p.detach().clone().float() for n, p in engine.module.named_parameters()}


def test_full_token_count_equals_the_plain_model_and_the_schedule_follows_steps() -> None:
    torch.manual_seed(0)
    plain, *_ = zcore.initialize(_model(), config=_config(0, None))
    torch.manual_seed(0)
    full, *_ = zcore.initialize(_model(), config=_config(0, keep=T))
    assert _train(plain, 3) == _train(full, 3)
    a, b = _params(plain), _params(full)
    assert all(torch.equal(a[n], b[n]) for n in a)
    plain.destroy()
    full.destroy()

    ltd, *_ = zcore.initialize(_model(), config=_config(0, keep=8))
    kept = []
    for step in range(6):
        _train_one = _train(ltd, 1)
        kept.append(ltd.random_ltd.keep)
        assert math.isfinite(_train_one[0]) and ltd.global_steps == step + 1
    assert kept == [8, 8, 20 - 20 % 8, 26 - 26 % 8, 32, 32]  # floor(s/4 * 24 + 8), multiples of 8
    ltd.eval()
    ltd(*_batch(0, 0, 0, 4))  # eval forwards neither move the schedule nor drop tokens
    assert ltd.random_ltd.scheduler.step == 5
    ltd.destroy()


def test_layer_token_lr_follows_layer_tokens_through_the_engine() -> None:
    engine, *_ = zcore.initialize(_model(), config=_config(0, keep=8, layer_token_lr=True))
    sched = engine.random_ltd.scheduler
    for step in range(6):
        c = sched.layer_tokens_before(step)  # what the run consumed before this step
        want = c / 8_000 if c < 8_000 else 0.5 * (1 + math.cos(math.pi * (c - 8_000) / 32_000))
        assert engine.get_lr()[0] == pytest.approx(3e-3 * want, rel=1e-12, abs=1e-15), step
        _train(engine, 1)
    # a step consumes global batch 8 x (kept x 2 random-LTD layers + T x 2 full layers)
    assert sched.layer_tokens_before(1) == 8 * (8 * 2 + T * 2)
    engine.destroy()


def test_a_layer_count_unlike_the_model_fails_at_start_naming_the_key() -> None:
    with pytest.raises(
        ValueError, match=r"random_ltd\.total_layer_num = 6: the model has 4 layers; set it to 4"
    ):
        zcore.initialize(_model(), config=_config(0, keep=8, total_layer_num=6))


def _two_ranks(rank: int, world: int, stage: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, keep in (("plain", None), ("full", T), ("ltd", 8)):
        torch.manual_seed(0)
        engine, *_ = zcore.initialize(_model(), config=_config(stage, keep, mb=2))
        out[name] = {"losses": _train(engine, 4, rank, mb=2), "params": _params(engine)}
        engine.destroy()
    return out


@pytest.mark.slow  # about 40 s on 2 busy cores: three engines on each of 2 ranks
def test_two_gloo_ranks_under_zero_equal_plain_at_full_tokens_and_train_with_dropping() -> None:
    ranks = run_ranks(_two_ranks, 2, args=(2,))
    for r in ranks:
        assert r["plain"]["losses"] == r["full"]["losses"]
        for n, p in r["plain"]["params"].items():
            assert torch.equal(p, r["full"]["params"][n]), n
        assert all(math.isfinite(x) for x in r["ltd"]["losses"])
    # the ranks drew different tokens but ZeRO keeps one model
    for n, p in ranks[0]["ltd"]["params"].items():
        assert torch.equal(p, ranks[1]["ltd"]["params"][n]), n
    assert any(
        not torch.equal(p, ranks[0]["plain"]["params"][n])
        for n, p in ranks[0]["ltd"]["params"].items()
    )


def test_zero_stage_3_drops_the_same_tokens_as_stage_0() -> None:
    """Stage 3's gather hooks wrap the routed forward: one process, same draws, same losses."""
    losses = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        engine, *_ = zcore.initialize(_model(), config=_config(stage, keep=8))
        torch.manual_seed(1)
        losses[stage] = _train(engine, 3)
        engine.destroy()
    assert losses[0] == losses[3]
