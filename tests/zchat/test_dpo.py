"""zchat.dpo: the DPO loss against a readable per-pair reference (with label smoothing), the
summed answer log-probabilities against a per-row computation without padding, and (slow)
a 2-rank ZeRO-3 run whose first loss is ln 2 (policy == reference) and whose reference
log-probabilities equal a frozen plain transformers copy's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.utils.tiny_lm import write_tiny_lm
from zchat.config import ChatConfigError, load_config
from zchat.data import build_chat_data, load_tokenizer, render_answer
from zchat.dpo import DPOConfig, dpo_loss, pair_logps, train_dpo


def readable_dpo(pc: float, pr: float, rc: float, rr: float, beta: float, eps: float) -> float:
    """One pair: -(1-eps) log sigmoid(z) - eps log sigmoid(-z), z = beta((pc-rc) - (pr-rr))."""
    z = beta * ((pc - rc) - (pr - rr))

    def log_sigmoid(x: float) -> float:
        return -math.log1p(math.exp(-x))

    return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_dpo_loss_equals_the_readable_formula(eps: float) -> None:
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(5, generator=g, dtype=torch.float64) * 20 for _ in range(4))
    loss, z = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=eps)
    rows = zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), strict=True)
    expected = [readable_dpo(*row, beta=0.1, eps=eps) for row in rows]
    assert float(loss) == pytest.approx(sum(expected) / 5, rel=1e-12)
    torch.testing.assert_close(z, 0.1 * ((pc - rc) - (pr - rr)))
    same, _ = dpo_loss(pc, pr, pc, pr, beta=0.1)  # policy == reference: ln 2 whatever the pair
    assert float(same) == pytest.approx(math.log(2), rel=1e-12)


def test_pair_logps_sum_the_answer_tokens_of_each_row(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    lm = write_tiny_lm(tmp_path / "lm")
    tok = load_tokenizer(lm)
    model = LlamaForCausalLM.from_pretrained(lm, dtype=torch.float32).eval()
    pairs = build_chat_data("arithmetic", train=3, heldout=0, seed=1).pairs_train
    with torch.no_grad():
        chosen, rejected, tokens = pair_logps(model, tok, pairs, 512)
        for i, pair in enumerate(pairs):
            for answer, got in ((pair.chosen, chosen[i]), (pair.rejected, rejected[i])):
                ids, labels = render_answer(tok, pair.messages, answer)
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
                # token t is predicted at position t-1; only answer tokens count
                want = sum(
                    float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if labels[t] != -100
                )
                assert float(got) == pytest.approx(want, abs=1e-4)
    assert tokens > 0


def test_bad_beta_is_named() -> None:
    with pytest.raises(ChatConfigError, match=r"`beta` must be > 0, got -0\.1"):
        load_config(DPOConfig, model="m", out="o", beta=-0.1)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 2 ranks loading transformers on a busy 2-core machine
def test_two_rank_dpo_starts_at_ln2_with_a_frozen_reference(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    lm = write_tiny_lm(tmp_path / "lm")
    cfg = load_config(
        DPOConfig,
        model=str(lm),
        out=str(tmp_path / "dpo"),
        steps=3,
        micro_batch=2,
        lr=1e-3,
        train_examples=16,
        heldout_examples=6,
        persistence_threshold=100,
    )
    results: list[dict[str, Any]] = run_ranks(train_dpo, 2, args=(cfg,), timeout=600)
    r = results[0]
    assert r["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    # (each step sees other pairs, so three losses need not fall; the policy moving away
    # from the reference is checked on the held-out pairs below)
    assert r["heldout_before"]["margin"] == 0.0
    # the saved policy moved, and the reference it was measured against is the start model
    tok = load_tokenizer(lm)
    held = build_chat_data("arithmetic", train=16, heldout=6, seed=0).pairs_heldout
    start = LlamaForCausalLM.from_pretrained(lm, dtype=torch.float32).eval()
    after = LlamaForCausalLM.from_pretrained(cfg.out, dtype=torch.float32).eval()
    with torch.no_grad():
        rc, rr, _ = pair_logps(start, tok, held, 512)
        pc, pr, _ = pair_logps(after, tok, held, 512)
    _, z = dpo_loss(pc, pr, rc, rr, cfg.beta)
    assert float(z.mean()) == pytest.approx(r["heldout_after"]["margin"], abs=1e-4)
