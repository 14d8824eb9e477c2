"""zchat.reward: the pairwise loss against its formula, the score read at the last real
token, a save/load round trip with identical scores, and a reward model whose tokenizer
is not the actor's refused naming both directories."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.tiny_lm import write_tiny_lm
from zchat.data import answer_batch, build_chat_data, load_tokenizer
from zchat.reward import (
    RewardModelError,
    build_reward_model,
    check_same_tokenizer,
    load_reward_model,
    pairwise_loss,
    save_reward_model,
)


def test_pairwise_loss_is_the_formula() -> None:
    chosen, rejected = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.0])
    expected = (
        sum(
            -math.log(1 / (1 + math.exp(-(c - r))))
            for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True)
        )
        / 3
    )
    assert float(pairwise_loss(chosen, rejected)) == pytest.approx(expected, rel=1e-6)


def test_score_is_the_last_real_token_and_survives_save_load(tmp_path: Path) -> None:
    lm = write_tiny_lm(tmp_path / "lm")
    tok = load_tokenizer(lm)
    model = build_reward_model(lm, seed=1)
    pairs = build_chat_data("arithmetic", train=3, heldout=0).pairs_train
    batch = answer_batch(
        tok, [(p.messages, p.chosen if i else p.rejected + "0000") for i, p in enumerate(pairs)]
    )
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert not mask.all()  # padded rows
    with torch.no_grad():
        scores = model(ids, mask)
        for i in range(len(pairs)):  # each row alone, unpadded
            n = int(mask[i].sum())
            alone = model.values(ids[i : i + 1, :n], mask[i : i + 1, :n])[0, -1]
            torch.testing.assert_close(scores[i], alone, rtol=0, atol=1e-5)
    save_reward_model(model, tmp_path / "rm", tokenizer=tok, source=lm, extra={"acc": 0.5})
    meta = json.loads((tmp_path / "rm" / "zchat_reward.json").read_text())
    assert meta["backbone"] == "LlamaModel" and meta["acc"] == 0.5
    with torch.no_grad():
        torch.testing.assert_close(
            load_reward_model(tmp_path / "rm")(ids, mask), scores, rtol=0, atol=0
        )
    check_same_tokenizer(tmp_path / "rm", tok, lm)  # the same tokenizer: accepted


def test_other_tokenizer_is_refused_naming_both(tmp_path: Path) -> None:
    lm = write_tiny_lm(tmp_path / "lm")
    tok = load_tokenizer(lm)
    save_reward_model(build_reward_model(lm), tmp_path / "rm", tokenizer=tok, source=lm)
    actor = tmp_path / "actor"  # the same model, its tokenizer with one more token
    shutil.copytree(lm, actor)
    other = load_tokenizer(lm)
    other.add_tokens(["<zchat_extra>"])
    other.save_pretrained(str(actor))
    with pytest.raises(RewardModelError, match=rf"`{tmp_path / 'rm'}`.*`{actor}`.*z chat reward"):
        check_same_tokenizer(tmp_path / "rm", load_tokenizer(actor), actor)
    with pytest.raises(RewardModelError, match="not a zchat reward model"):
        load_reward_model(lm)


def _reference_reward(cfg: Any, world: int) -> tuple[list[float], Any]:
    """The same steps in one process: a whole RewardModel, torch AdamW, the whole batch."""
    from zchat.reward_train import pair_batch
    from zchat.sft import build_stage_data
    from zchat.train_loop import global_batches, lr_factor

    tok = load_tokenizer(cfg.model)
    model = build_reward_model(cfg.model, seed=cfg.seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    pairs = build_stage_data(cfg).pairs_train
    losses = []
    for batch in global_batches(pairs, cfg.micro_batch * world, cfg.steps, cfg.seed):
        b = pair_batch(tok, batch, cfg.max_len)
        scores = model(b["input_ids"], b["attention_mask"])
        loss = pairwise_loss(scores[: len(batch)], scores[len(batch) :])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model.eval()


@pytest.mark.slow
@pytest.mark.timeout(900)  # 2 ranks loading transformers on a busy 2-core machine
def test_two_rank_reward_training_equals_plain_adamw(tmp_path: Path) -> None:
    """ZeRO-3 on 2 gloo ranks against one process: losses rel 1e-5; the saved model's scores
    against the reference model's atol 1e-4."""
    from tests.utils.distributed import run_ranks
    from zchat.config import load_config
    from zchat.reward_train import RewardConfig, train_reward

    lm = write_tiny_lm(tmp_path / "lm")
    cfg = load_config(
        RewardConfig,
        model=str(lm),
        out=str(tmp_path / "rm"),
        steps=3,
        micro_batch=2,
        lr=1e-3,
        train_examples=16,
        heldout_examples=4,
        persistence_threshold=100,
    )
    results = run_ranks(train_reward, 2, args=(cfg,), timeout=600)
    ref_losses, ref = _reference_reward(cfg, 2)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    tok = load_tokenizer(lm)
    pairs = build_chat_data("arithmetic", train=4, heldout=0, seed=5).pairs_train
    b = answer_batch(tok, [(p.messages, p.chosen) for p in pairs])
    with torch.no_grad():
        torch.testing.assert_close(
            load_reward_model(cfg.out)(b["input_ids"], b["attention_mask"]),
            ref(b["input_ids"], b["attention_mask"]),
            rtol=0,
            atol=1e-4,
        )
    meta = json.loads((Path(cfg.out) / "zchat_reward.json").read_text())
    assert meta["heldout_accuracy"] == results[0]["heldout_after"]["accuracy"]
