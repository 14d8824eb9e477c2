"""The reward model's levers (zchat.reward_warmup, RewardModel's ``score_at``): the head-only
warm-up reaches the optimum of its convex objective (zero gradient of the written formula),
fits exactly the features the model scores, and leaves the backbone bit-identical;
``before_eos`` reads the answer's own last token; the new config keys are checked and an
unknown one is still refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.utils.tiny_lm import write_tiny_lm
from zchat.config import ChatConfigError, load_config
from zchat.data import answer_batch, build_chat_data, load_tokenizer
from zchat.reward import build_reward_model, load_reward_model, save_reward_model
from zchat.reward_train import RewardConfig, pair_batch
from zchat.reward_warmup import fit_head, probe_loss, warm_head


def test_fit_head_reaches_the_optimum_of_the_written_objective() -> None:
    g = torch.Generator().manual_seed(0)
    rejected = torch.randn(64, 8, generator=g, dtype=torch.float64)
    chosen = rejected + 0.5 + torch.randn(64, 8, generator=g, dtype=torch.float64)
    init = torch.zeros(1, 8)
    l2 = 1e-2
    head = fit_head(chosen, rejected, init, l2=l2, iters=200).reshape(-1)
    d = chosen - rejected
    # d/dw [mean(-logsigmoid(d @ w)) + l2 |w|^2] = -mean(sigmoid(-d @ w) d) + 2 l2 w
    grad = -(torch.sigmoid(-(d @ head))[:, None] * d).mean(0) + 2 * l2 * head
    assert float(grad.abs().max()) < 1e-6
    assert probe_loss(head, chosen, rejected) < probe_loss(init, chosen, rejected)
    assert float(((d @ head) > 0).double().mean()) > 0.9  # chosen lies 0.5 further on each axis


def test_warmup_fits_the_scored_features_and_leaves_the_backbone_bit_identical(
    tmp_path: Path,
) -> None:
    lm = write_tiny_lm(tmp_path / "lm")
    tok = load_tokenizer(lm)
    data = build_chat_data("arithmetic", train=12, heldout=4, seed=3)
    cfg = load_config(
        RewardConfig,
        model=str(lm),
        out=str(tmp_path / "rm"),
        score_at="before_eos",
        train_examples=12,
        heldout_examples=4,
        head_warmup_pairs=12,
        eval_batch=5,
        head_warmup_iters=50,
    )
    head, stats = warm_head(str(lm), tok, data.pairs_train, data.pairs_heldout, cfg, 0, 1)
    assert stats["probe_loss_after"] < stats["probe_loss_before"]
    assert stats["probe_pairs"] == 12 and 0 <= stats["heldout_accuracy_warm_head"] <= 1
    fresh = build_reward_model(lm, seed=cfg.seed)
    warm = build_reward_model(
        lm, seed=cfg.seed, head=head, score_at="before_eos", eos_id=tok.eos_token_id
    )
    for (name, a), (_, b) in zip(
        fresh.backbone.state_dict().items(), warm.backbone.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert torch.equal(warm.v_head.weight.detach(), head)
    assert not torch.equal(fresh.v_head.weight.detach(), head)
    b = pair_batch(tok, data.pairs_train[:3], cfg.max_len)  # the warm head's score = w . feature
    with torch.no_grad():
        feats = warm.scored_hidden(b["input_ids"], b["attention_mask"])
        torch.testing.assert_close(
            warm(b["input_ids"], b["attention_mask"]),
            (feats @ head.t()).squeeze(1),
            rtol=0,
            atol=1e-5,
        )


def test_before_eos_reads_the_answers_last_token_and_survives_save_load(tmp_path: Path) -> None:
    lm = write_tiny_lm(tmp_path / "lm")
    tok = load_tokenizer(lm)
    eos = tok.eos_token_id
    model = build_reward_model(lm, seed=2, score_at="before_eos", eos_id=eos)
    pairs = build_chat_data("arithmetic", train=2, heldout=0).pairs_train
    b = answer_batch(
        tok, [(pairs[0].messages, pairs[0].chosen), (pairs[1].messages, pairs[1].chosen + "123")]
    )
    ids, mask = b["input_ids"].clone(), b["attention_mask"].clone()
    last = mask.sum(1) - 1
    assert int(ids[0, last[0]]) == eos and int(ids[1, last[1]]) == eos
    mask[1, last[1]] = 0  # row 1 cut before its end-of-turn token (a truncated rollout)
    assert model.score_index(ids, mask).tolist() == [int(last[0]) - 1, int(last[1]) - 1]
    with torch.no_grad():
        values = model.values(ids, mask)
        scores = model(ids, mask)
        torch.testing.assert_close(
            scores, torch.stack([values[0, last[0] - 1], values[1, last[1] - 1]])
        )
        save_reward_model(model, tmp_path / "rm", tokenizer=tok, source=lm)
        meta = json.loads((tmp_path / "rm" / "zchat_reward.json").read_text())
        assert meta["score_at"] == "before_eos" and meta["eos_id"] == eos
        torch.testing.assert_close(
            load_reward_model(tmp_path / "rm")(ids, mask), scores, rtol=0, atol=0
        )
    with pytest.raises(ValueError, match="before_eos needs the tokenizer's `eos_id`"):
        build_reward_model(lm, score_at="before_eos")


def test_reward_config_keys_are_checked() -> None:
    base = {"model": "m", "out": "o"}
    cfg = load_config(RewardConfig, base, head_lr=1e-3, head_warmup_pairs=64)
    assert (cfg.head_lr, cfg.head_warmup_pairs, cfg.score_at) == (1e-3, 64, "last")
    with pytest.raises(ChatConfigError, match=r"unknown key `head_learning_rate`.*head_lr"):
        load_config(RewardConfig, base, head_learning_rate=1e-3)
    with pytest.raises(ChatConfigError, match=r"`head_lr` must be > 0"):
        load_config(RewardConfig, base, head_lr=0.0)
    with pytest.raises(ChatConfigError, match=r"`head_warmup_pairs` and `head_warmup_l2` must"):
        load_config(RewardConfig, base, head_warmup_pairs=-1)
    with pytest.raises(ChatConfigError, match=r"`score_at`"):
        load_config(RewardConfig, base, score_at="first")


def _warm_rank(rank: int, world: int, lm: str, cfg: RewardConfig) -> torch.Tensor:
    data = build_chat_data("arithmetic", train=7, heldout=3, seed=4)
    head, _ = warm_head(
        lm, load_tokenizer(lm), data.pairs_train, data.pairs_heldout, cfg, rank, world
    )
    return head


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_rank_warmup_gathers_in_pair_order_and_fits_the_one_process_head(
    tmp_path: Path,
) -> None:
    """2 gloo ranks each score every other pair (7: uneven shares); the gathered features give
    bit-identical heads on both ranks, equal to one process's within float64 rounding."""
    from tests.utils.distributed import run_ranks

    lm = str(write_tiny_lm(tmp_path / "lm"))
    cfg = load_config(
        RewardConfig,
        model=lm,
        out=str(tmp_path / "rm"),
        head_warmup_pairs=7,
        score_at="before_eos",
        eval_batch=2,
        head_warmup_iters=50,
    )
    heads = run_ranks(_warm_rank, 2, args=(lm, cfg), timeout=300)
    assert torch.equal(heads[0], heads[1])
    torch.testing.assert_close(heads[0], _warm_rank(0, 1, lm, cfg), rtol=1e-5, atol=1e-6)
