"""GRPO's group-relative advantages and its KL estimate against readable references, and
one GRPO step in one process on a tiny random LLaMA (its metrics written, the actor saved)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from tests.utils.tiny_lm import write_tiny_lm
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
    cfg = GRPOConfig(
        actor=lm,
        out=tmp_path / "out",
        train_prompts=4,
        heldout_prompts=2,
        steps=1,
        prompts_per_rank=2,
        group_size=2,
        max_new_tokens=3,
        world=1,
    )
    result = grpo_rank(0, 1, cfg)
    assert 0.0 <= result["heldout_accuracy_after"] <= 1.0
    step = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["step"] == 1 and step["gen_tokens_per_s"] > 0 and step["kl"] >= 0.0
    assert (tmp_path / "out" / "actor" / "config.json").is_file()


@pytest.mark.slow
def test_one_process_lora_step_with_sampled_heldout(tmp_path: Path) -> None:
    """A LoRA-only actor (its frozen base is the reference) with fixed-seed sampled held-out
    answers: both accuracies reported before and after, the saved actor merged (plain
    architecture, no LoRA names)."""
    from safetensors.torch import load_file

    lm = write_tiny_lm(tmp_path / "lm")
    cfg = GRPOConfig(
        actor=lm,
        out=tmp_path / "out",
        train_prompts=4,
        heldout_prompts=2,
        steps=1,
        prompts_per_rank=2,
        group_size=2,
        max_new_tokens=3,
        world=1,
        actor_lora_dim=2,
        actor_lora_module_name="layers.",
        only_optimize_lora=True,
        heldout_samples=2,
    )
    result = grpo_rank(0, 1, cfg)
    for key in ("heldout_accuracy", "heldout_sampled_accuracy"):
        assert 0.0 <= result[f"{key}_before"] <= 1.0 and 0.0 <= result[f"{key}_after"] <= 1.0
    saved = load_file(str(tmp_path / "out" / "actor" / "model.safetensors"))
    assert saved and not any("lora" in k for k in saved)


def test_lora_reference_is_the_base_model(tmp_path: Path) -> None:
    """ref_logprobs of a LoRA-only engine (its LoRA matrices non-zero, so the actor differs
    from its base) equal the plain starting model's log-probabilities."""
    from transformers import AutoModelForCausalLM

    import zcore
    from zchat.grpo import ref_logprobs
    from zchat.lora import convert_to_lora, lora_modules, only_optimize_lora_
    from zchat.ppo.experience import Batch, token_logprobs

    lm = write_tiny_lm(tmp_path / "lm")
    plain = AutoModelForCausalLM.from_pretrained(str(lm), dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(lm), dtype=torch.float32)
    convert_to_lora(model, "layers.", 2, key="actor_lora_module_name")
    only_optimize_lora_(model)
    with torch.no_grad():
        for layer in lora_modules(model).values():
            layer.lora_left_weight.normal_(std=0.5)
            layer.lora_right_weight.normal_(std=0.5)
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine = zcore.initialize(model, config=ds)[0]
    batch = Batch.build([[1, 5, 9], [1, 7]], [[11, 12], [13]], pad_id=0)
    with torch.no_grad():
        want = token_logprobs(plain, batch)
        assert not torch.allclose(token_logprobs(engine, batch), want)  # LoRA is on
    torch.testing.assert_close(ref_logprobs(engine, batch, 1), want)


def _sgd_engine(lm: Path, accum: int) -> object:
    from transformers import AutoModelForCausalLM

    import zcore

    model = AutoModelForCausalLM.from_pretrained(str(lm), dtype=torch.float32)
    ds = {
        "train_micro_batch_size_per_gpu": 4 // accum,
        "gradient_accumulation_steps": accum,
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
    }
    return zcore.initialize(model, config=ds)[0]


def test_micro_batches_give_the_whole_rollout_step(tmp_path: Path) -> None:
    """grpo_backward over 2 micro-batches of unequal token counts == over the whole rollout ==
    plain SGD on the readable loss ``mean_tokens(-adv * logp + beta * k3)`` (the clipped
    surrogate's gradient at ratio 1)."""
    from transformers import AutoModelForCausalLM

    from zchat.grpo import grpo_backward, ref_logprobs
    from zchat.ppo.experience import Batch, token_logprobs

    lm = write_tiny_lm(tmp_path / "lm")
    ref = AutoModelForCausalLM.from_pretrained(str(lm), dtype=torch.float32).requires_grad_(False)
    with torch.no_grad():  # a reference that differs, so the KL term has a gradient
        ref.lm_head.weight.mul_(0.9)
    prompts = [[1, 5, 9], [1, 7], [1, 4, 4, 8], [1, 3]]
    responses = [[11], [12, 13, 14], [15, 16], [17, 18, 19, 20, 21]]  # halves: 4 vs 7 tokens
    batch = Batch.build(prompts, responses, pad_id=0)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])[:, None] * batch.mask
    whole, split = _sgd_engine(lm, 1), _sgd_engine(lm, 2)
    plain = AutoModelForCausalLM.from_pretrained(str(lm), dtype=torch.float32)
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    ref_lp = ref_logprobs(ref, batch, 3)  # micro 3 of 4 rows: a short last chunk
    got_whole = grpo_backward(whole, ref_lp, batch, adv, 4, kl_coef=0.5, clip=0.2)
    got_split = grpo_backward(split, ref_lp, batch, adv, 2, kl_coef=0.5, clip=0.2)
    lp = token_logprobs(plain, batch)
    with torch.no_grad():
        torch.testing.assert_close(ref_lp, token_logprobs(ref, batch))
    readable = ((-adv * lp + 0.5 * kl_k3(lp, ref_lp)) * batch.mask).sum() / batch.mask.sum()
    readable.backward()
    with torch.no_grad():
        for p in plain.parameters():
            p -= p.grad
    want = plain.state_dict()
    moved = max(float((want[k] - start[k]).abs().max()) for k in want)
    assert moved > 1e-3  # the step is not trivially zero
    for engine in (whole, split):
        for k, v in engine.module.state_dict().items():
            torch.testing.assert_close(v, want[k], atol=2e-6, rtol=1e-5)
    assert got_split == pytest.approx(got_whole, abs=1e-6)


def test_config_refuses_lora_only_without_lora(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`only_optimize_lora` needs LoRA"):
        GRPOConfig(actor=tmp_path, out=tmp_path, only_optimize_lora=True)


def test_config_refuses_a_micro_batch_that_does_not_divide(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`micro_batch` 3 must be 0 or divide"):
        GRPOConfig(actor=tmp_path, out=tmp_path, prompts_per_rank=2, group_size=4, micro_batch=3)
