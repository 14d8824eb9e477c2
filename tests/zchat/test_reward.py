"""zchat.reward: the pairwise loss against its formula, the score read at the last real
token, a save/load round trip with identical scores, and a reward model whose tokenizer
is not the actor's refused naming both directories."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.zstack.tiny_lm import write_tiny_lm
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
    expected = sum(-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in
                   zip(chosen.tolist(), rejected.tolist(), strict=True)) / 3  # fmt: skip
    assert float(pairwise_loss(chosen, rejected)) == pytest.approx(expected, rel=1e-6)


def test_score_is_the_last_real_token_and_survives_save_load(tmp_path: Path) -> None:
    lm = write_tiny_lm(tmp_path / "lm")
    tok = load_tokenizer(lm)
    model = build_reward_model(lm, seed=1)
    pairs = build_chat_data("arithmetic", train=3, heldout=0).pairs_train
    batch = answer_batch(tok, [(p.messages, p.chosen if i else p.rejected + "0000")
                               for i, p in enumerate(pairs)])  # fmt: skip
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
        torch.testing.assert_close(load_reward_model(tmp_path / "rm")(ids, mask), scores,
                                   rtol=0, atol=0)  # fmt: skip
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
