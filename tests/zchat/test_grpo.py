"""GRPO's group-relative advantages and its KL estimate against readable references, and
one GRPO step in one process on a tiny random LLaMA (its metrics written, the actor saved)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from tests.zstack.tiny_lm import write_tiny_lm
from zchat.grpo import GRPOConfig, group_advantages, grpo_rank, kl_k3


def test_group_advantages_standardise_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    got = group_advantages(rewards, 4, eps=1e-4).tolist()
    for g in range(3):
        group = rewards[g * 4 : (g + 1) * 4].tolist()
        mean, std = statistics.mean(group), statistics.stdev(group)  # unbiased, as torch.std
        want = [(r - mean) / (std + 1e-4) for r in group]
        assert got[g * 4 : (g + 1) * 4] == pytest.approx(want, abs=1e-6)
    assert got[4:8] == [0.0] * 4  # all alike: nothing to learn from the group


def test_k3_kl_estimate() -> None:
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -2.0, -0.1])
    want = [math.exp(r - p) - (r - p) - 1 for p, r in zip(logp.tolist(), ref.tolist(), strict=True)]
    assert kl_k3(logp, ref).tolist() == pytest.approx(want, abs=1e-7)
    assert float(kl_k3(logp, ref).min()) >= 0.0


def test_config_refuses_negative_kl(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`kl_coef` -1\.0 < 0"):
        GRPOConfig(actor=tmp_path, out=tmp_path, kl_coef=-1.0)


@pytest.mark.slow
def test_one_process_step(tmp_path: Path) -> None:
    """(85 s of wall time here under load; 16 s of CPU.)"""
    lm = write_tiny_lm(tmp_path / "lm")
    cfg = GRPOConfig(actor=lm, out=tmp_path / "out", train_prompts=4, heldout_prompts=2, steps=1,
                     prompts_per_rank=2, group_size=2, max_new_tokens=3, world=1)  # fmt: skip
    result = grpo_rank(0, 1, cfg)
    assert 0.0 <= result["heldout_accuracy_after"] <= 1.0
    step = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["step"] == 1 and step["gen_tokens_per_s"] > 0 and step["kl"] >= 0.0
    assert (tmp_path / "out" / "actor" / "config.json").is_file()
