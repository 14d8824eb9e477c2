"""A PEFT LoRA model under zcore.hf.Trainer at ZeRO-2 and ZeRO-3 (frozen base built
partitioned) on 2 gloo ranks trains like transformers' plain Trainer on the same adapter; only
the adapter is optimised and saved, and PeftModel.from_pretrained loads the saved directory.

Tolerances as in test_trainer.py (fp32): per-step losses and gradient norms rel 1e-5, the
reloaded adapter's logits against the plain run's atol 1e-4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.zcore.hf import trainer_common as tc
from tests.zcore.hf.test_trainer import PER_EPOCH


def _lora_rank(
    rank: int, world: int, model_dir: str, tmp: str, stages: list[int], steps: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in stages:
        trainer = tc.zcore_trainer(
            world,
            model_dir,
            f"{tmp}/z{stage}",
            stage,
            steps * PER_EPOCH,
            lora=True,
            num_train_epochs=1,
        )
        trainer.train()
        out[stage] = tc.history(trainer)
        optimised = [p for g in trainer.engine.optimizer.param_groups for p in g["params"]]
        out[f"optimised{stage}"] = sum(p.numel() for p in optimised)
    out["adapter"] = sum(
        int(torch.Size(getattr(p, "z_shape", p.shape)).numel())
        for n, p in trainer.model.named_parameters()
        if "lora_" in n
    )
    trainer.model.eval()
    out["greedy"] = tc.greedy(trainer.model)
    trainer.save_model(f"{tmp}/adapter")
    return out


def check_lora(tmp_path: Path, stages: list[int], steps: int) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = tc.write_model(tmp_path / "tiny")
    args = (str(model_dir), str(tmp_path), stages, steps)
    results = run_ranks(_lora_rank, tc.WORLD, args=args, timeout=600)
    plain = tc.plain_lora_run(model_dir, tmp_path / "plain", steps * PER_EPOCH, num_train_epochs=1)
    ref = plain["history"]
    for stage in stages:
        for r in results:
            got = r[stage]
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), (stage, got, ref)
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (stage, got)
            # the optimizer holds this rank's slot of the adapter only, never the base
            assert r[f"optimised{stage}"] <= r["adapter"], stage
    saved = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert "adapter_config.json" in saved and "adapter_model.safetensors" in saved
    assert "model.safetensors" not in saved
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with tc.peft_quietly():
        reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert tc.greedy(reloaded) == results[0]["greedy"] == results[1]["greedy"]
    with torch.no_grad():
        ids = torch.tensor([tc.PROBE])
        torch.testing.assert_close(
            reloaded(ids).logits, plain["model"].eval()(ids).logits, rtol=0, atol=1e-4
        )


def test_lora_at_zero2_and_zero3_trains_like_the_plain_trainer(tmp_path: Path) -> None:
    check_lora(tmp_path, [2, 3], steps=3)


@pytest.mark.slow(
    reason="issue 47's 20-step LoRA run at ZeRO-3; "
    "test_lora_at_zero2_and_zero3_trains_like_the_plain_trainer covers the path in 3 steps"
)
def test_lora_at_zero3_over_20_steps(tmp_path: Path) -> None:
    check_lora(tmp_path, [3], steps=20)
