"""End to end without the engine: the `small` GPT learns the plays on one process."""

from __future__ import annotations

import math

import pytest
import torch

from ztrain.data import ShakespeareData
from ztrain.generate import generate
from ztrain.gpt import GPT, GPTConfig
from ztrain.tokenizer import Tokenizer


@pytest.mark.slow
def test_small_gpt_val_loss_falls(data: ShakespeareData, tokenizer: Tokenizer) -> None:
    steps, seq_len = 60, 128
    model = GPT(GPTConfig.preset("small", vocab_size=tokenizer.vocab_size), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    train, val = data.stream("train", seq_len), data.stream("val", seq_len)

    def val_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = [model(*val.get_micro_batch(i, 0, 0, 1, 16))[1].item() for i in range(2)]
        model.train()
        return sum(losses) / len(losses)

    before = val_loss()
    assert abs(before - math.log(tokenizer.vocab_size)) < 0.3
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * min(1.0, (step + 1) / 10)
        _, loss = model(*train.get_micro_batch(step, 0, 0, 1, 8))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    after = val_loss()
    assert after < before - 1.5, (before, after)
    assert generate(model, tokenizer, "HAMLET:\n", 20, seed=0).startswith("HAMLET:\n")
