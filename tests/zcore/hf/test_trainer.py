"""zcore.hf.Trainer on 2 gloo ranks trains like transformers' plain single-process Trainer.

The same tiny random LLaMA, data, seed and TrainingArguments (gradient accumulation 2,
clipping at 0.5 below every step's norm, linear schedule with warm-up, AdamW with the Trainer's
no-decay groups); the ZeRO config says "auto" wherever TrainingArguments decides. Tolerances
(fp32): per-step losses and gradient norms rel 1e-5 (the ranks sum gradients in another
order; measured ~1e-7), learning rates exact; outputs of the saved directory against the
plain run's model atol 1e-4 (a few steps of lr 3e-3 on fp32 noise).

Each test is one call of 2 ranks, which each import transformers (most of the test's time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.zcore.hf import trainer_common as tc

STEPS = 3  # optimizer steps per epoch; 1 epoch
SAMPLES = STEPS * tc.MB * tc.GAS * tc.WORLD
PROBE = [5, 17, 3, 99, 42]
NEW_TOKENS = 6


def greedy(model: Any) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROBE]),
            attention_mask=torch.ones(1, len(PROBE), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return out[0, len(PROBE) :].tolist()


def _stages_rank(rank: int, world: int, model_dir: str, tmp: str) -> dict[str, Any]:
    """ZeRO-2 then ZeRO-3 (built partitioned); the stage-3 model saved and generating."""
    out: dict[str, Any] = {}
    for stage in (2, 3):
        trainer = tc.zcore_trainer(
            rank, model_dir, f"{tmp}/z{stage}", stage, SAMPLES, num_train_epochs=1
        )
        trainer.train()
        out[stage] = tc.history(trainer)
    out["sizes"] = {n: p.numel() for n, p in trainer.model.named_parameters()}
    trainer.model.eval()
    out["greedy"] = greedy(trainer.model)  # collective at stage 3: every rank generates
    out["sizes_after"] = {n: p.numel() for n, p in trainer.model.named_parameters()}
    trainer.save_model(f"{tmp}/saved")
    return out


def test_zero2_and_zero3_train_like_the_plain_trainer(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tc.write_model(tmp_path / "tiny")
    results = run_ranks(_stages_rank, tc.WORLD, args=(str(model_dir), str(tmp_path)), timeout=120)
    plain = tc.plain_run(model_dir, tmp_path / "plain", SAMPLES, num_train_epochs=1)
    ref = plain["history"]
    assert len(ref["loss"]) == STEPS
    assert all(n > tc.CLIP for n in ref["grad_norm"])  # clipping is active on every step
    for stage in (2, 3):
        for r in results:
            got = r[stage]
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), (stage, got, ref)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (stage, got)
            assert got["learning_rate"] == ref["learning_rate"], stage
    # stage 3: the big matrices were partitioned on each rank, never whole
    assert results[0]["sizes"]["model.embed_tokens.weight"] == 0
    assert results[0]["sizes_after"]["model.embed_tokens.weight"] == 0  # released after generate
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    assert greedy(saved) == results[0]["greedy"] == results[1]["greedy"]
    with torch.no_grad():
        ids = torch.tensor([PROBE])
        torch.testing.assert_close(
            saved(ids).logits, plain["model"].eval()(ids).logits, rtol=0, atol=1e-4
        )


def _resume_rank(rank: int, world: int, model_dir: str, tmp: str, stage: int) -> dict[str, Any]:
    """The uninterrupted run (checkpoints every 2 steps), then a run resumed from step 2."""
    ov = {"num_train_epochs": 1, "save_strategy": "steps", "save_steps": 2}
    full = tc.zcore_trainer(rank, model_dir, f"{tmp}/full", stage, 2 * SAMPLES, **ov)
    full.train()
    resumed = tc.zcore_trainer(rank, model_dir, f"{tmp}/resumed", stage, 2 * SAMPLES, **ov)
    resumed.train(resume_from_checkpoint=f"{tmp}/full/checkpoint-2")
    return {"full": tc.history(full), "resumed": tc.history(resumed)}


@pytest.mark.parametrize("stage", [3])
def test_resume_from_a_checkpoint_gives_the_uninterrupted_losses(
    tmp_path: Path, stage: int
) -> None:
    model_dir = tc.write_model(tmp_path / "tiny")
    results = run_ranks(
        _resume_rank, tc.WORLD, args=(str(model_dir), str(tmp_path), stage), timeout=120
    )
    ckpt = tmp_path / "full" / "checkpoint-2"
    names = {p.name for p in ckpt.iterdir()}
    assert {"model.safetensors", "config.json", "trainer_state.json", "global_step2"} <= names
    assert {f"rng_state_{r}.pth" for r in range(tc.WORLD)} <= names
    for r in results:
        full, resumed = r["full"], r["resumed"]
        assert len(full["loss"]) == 2 * STEPS
        # the resumed Trainer's history starts with the checkpoint's two logged steps
        assert resumed["loss"][:2] == full["loss"][:2]
        assert resumed["loss"][2:] == pytest.approx(full["loss"][2:], rel=1e-6)
        assert resumed["learning_rate"] == full["learning_rate"]
