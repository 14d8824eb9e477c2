"""The reward model's block warm-up (zchat.reward_blocks): the top blocks on cached inputs
score exactly what the whole reward model scores; training them lowers the pairwise loss,
touches only the top blocks, the norm and the head, and the trained tensors load into a
ZeRO-3 reward model; 2 gloo ranks end with the weights of one process taking the same steps;
the new keys are checked."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.utils.tiny_lm import write_tiny_lm
from zchat.config import ChatConfigError, load_config
from zchat.data import build_chat_data, load_tokenizer
from zchat.reward import build_reward_model
from zchat.reward_blocks import (
    TopBlocks,
    cached_rows,
    load_warm_weights,
    pair_scores,
    step_batches,
    warm_blocks,
)
from zchat.reward_train import RewardConfig, pair_batch


@pytest.mark.parametrize("score_at", ["last", "before_eos"])
def test_top_blocks_on_cached_inputs_score_what_the_whole_model_scores(
    tmp_path: Path, score_at: str
) -> None:
    lm = write_tiny_lm(tmp_path / "lm")
    tok = load_tokenizer(lm)
    model = build_reward_model(lm, seed=5, score_at=score_at, eos_id=tok.eos_token_id).eval()
    pairs = build_chat_data("arithmetic", train=5, heldout=0, seed=1).pairs_train
    pairs[1] = dataclasses.replace(pairs[1], rejected=pairs[1].rejected + " is my answer")
    top = TopBlocks(model, 1)
    assert top.first == 1
    rows = cached_rows(model, tok, pairs, top.first, 512, batch=2)
    b = pair_batch(tok, pairs, 512)
    with torch.no_grad():
        whole = model(b["input_ids"], b["attention_mask"])
        chosen, rejected = pair_scores(top, rows)
    torch.testing.assert_close(torch.cat([chosen, rejected]), whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"`warmup_blocks` must be in 1\.\.2"):
        TopBlocks(model, 3)


def test_step_batches_cover_every_pair_once_per_epoch() -> None:
    steps = step_batches(10, 4, 2, seed=0)
    assert [len(s) for s in steps] == [4, 4, 2, 4, 4, 2]
    first, second = (sorted(i for step in half for i in step) for half in (steps[:3], steps[3:]))
    assert first == list(range(10)) == second
    assert steps == step_batches(10, 4, 2, seed=0) != step_batches(10, 4, 2, seed=1)


def _cfg(lm: Path, out: Path, **keys: object) -> RewardConfig:
    base = {
        "model": str(lm),
        "out": str(out),
        "score_at": "before_eos",
        "warmup_blocks": 1,
        "warmup_epochs": 3,
        "warmup_batch": 4,
        "warmup_lr": 1e-3,
        "eval_batch": 3,
    }
    return load_config(RewardConfig, {**base, **keys})


def _warm(rank: int, world: int, lm: str, cfg: RewardConfig) -> dict[str, torch.Tensor]:
    data = build_chat_data("arithmetic", train=9, heldout=4, seed=2)
    warm, _ = warm_blocks(
        lm, load_tokenizer(lm), data.pairs_train, data.pairs_heldout, cfg, rank, world
    )
    return warm


def test_warmup_trains_only_the_top_blocks_and_loads_into_the_reward_model(
    tmp_path: Path,
) -> None:
    lm = write_tiny_lm(tmp_path / "lm")
    tok = load_tokenizer(lm)
    cfg = _cfg(lm, tmp_path / "rm")
    data = build_chat_data("arithmetic", train=9, heldout=4, seed=2)
    warm, stats = warm_blocks(str(lm), tok, data.pairs_train, data.pairs_heldout, cfg, 0, 1)
    assert set(warm) == {
        n
        for n, _ in build_reward_model(lm).named_parameters()
        if n.startswith(("backbone.layers.1.", "backbone.norm.", "v_head."))
    }
    assert len(stats["blocks_heldout_accuracy"]) == cfg.warmup_epochs + 1
    losses = stats["blocks_losses"]
    assert len(losses) == 3 * cfg.warmup_epochs  # 9 pairs in steps of 4: 3 steps an epoch
    assert losses[0] == pytest.approx(0.6931, abs=1e-4)  # a zero head: ln 2
    assert sum(losses[-3:]) < sum(losses[:3])
    model = build_reward_model(lm, seed=cfg.seed, score_at="before_eos", eos_id=tok.eos_token_id)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    load_warm_weights(model, warm)
    for name, p in model.named_parameters():
        want = warm.get(name, before[name])
        assert torch.equal(p.detach(), want), name
    assert any(not torch.equal(warm[n], before[n]) for n in warm if n.startswith("backbone."))
    with pytest.raises(KeyError, match="name no parameter"):
        load_warm_weights(model, {"backbone.layers.9.x": torch.zeros(1)})


def test_block_warmup_keys_are_checked() -> None:
    base = {"model": "m", "out": "o"}
    cfg = load_config(RewardConfig, base, warmup_blocks=4, steps=0)
    assert (cfg.warmup_blocks, cfg.steps, cfg.warmup_epochs) == (4, 0, 3)
    with pytest.raises(ChatConfigError, match=r"`steps` 0 trains nothing.*warmup_blocks"):
        load_config(RewardConfig, base, steps=0)
    with pytest.raises(ChatConfigError, match=r"`warmup_blocks` must be ≥ 0"):
        load_config(RewardConfig, base, warmup_blocks=-1)
    with pytest.raises(ChatConfigError, match=r"`warmup_lr` and `warmup_head_lr` must be > 0"):
        load_config(RewardConfig, base, warmup_blocks=1, warmup_lr=0.0)
    with pytest.raises(ChatConfigError, match=r"unknown key `warmup_block`"):
        load_config(RewardConfig, base, warmup_block=2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_end_with_the_weights_of_one_process(tmp_path: Path) -> None:
    """2 gloo ranks split the cached forward (9 pairs: uneven shares) and every step's pairs;
    both end bit-identical, equal to one process taking the same steps (the gradient sum
    over ranks is the one-process gradient up to float rounding)."""
    from tests.utils.distributed import run_ranks

    lm = write_tiny_lm(tmp_path / "lm")
    cfg = _cfg(lm, tmp_path / "rm")
    ranks = run_ranks(_warm, 2, args=(str(lm), cfg), timeout=300)
    one = _warm(0, 1, str(lm), cfg)
    for name, value in one.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_reward_stage_with_the_block_warmup_alone_saves_the_warmed_model(tmp_path: Path) -> None:
    """``z chat reward`` with ``warmup_blocks`` and ``steps`` 0 on 2 gloo ranks (ZeRO-3, the
    top block partitioned): the saved reward model holds the warm-up's tensors (those of one
    process taking the same steps), and the engine's held-out accuracy equals the warm-up's
    last one, computed on cached inputs."""
    from tests.utils.distributed import run_ranks
    from zchat.reward import load_reward_model
    from zchat.reward_train import train_reward

    lm = write_tiny_lm(tmp_path / "lm")
    cfg = _cfg(
        lm,
        tmp_path / "rm",
        steps=0,
        train_examples=9,
        heldout_examples=4,
        data_seed=2,
        persistence_threshold=100,
    )
    results = run_ranks(train_reward, 2, args=(cfg,), timeout=600)
    assert results[0]["losses"] == []
    warm = results[0]["warmup"]
    assert results[0]["heldout_before"]["accuracy"] == warm["blocks_heldout_accuracy"][-1]
    assert results[0]["heldout_after"] == results[0]["heldout_before"]
    saved = dict(load_reward_model(cfg.out).named_parameters())
    for name, value in _warm(0, 1, str(lm), cfg).items():
        torch.testing.assert_close(saved[name].detach(), value, rtol=1e-4, atol=1e-5)
