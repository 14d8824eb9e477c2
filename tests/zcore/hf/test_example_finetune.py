"""examples/hf_finetune/finetune.py, run as a user runs it, in a tiny configuration: a 2-layer
random LLaMA with SmolLM2's tokenizer on a short local text.

Default: one rank (no launcher: zcore starts its own process group), LoRA at ZeRO-3, the
adapter loaded by PeftModel. Slow: full fine-tuning at ZeRO-2 on 2 ranks through `z launch`,
the model loaded by transformers.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.utils.cli import run_z
from tests.utils.tiny_lm import write_tiny_lm

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "hf_finetune" / "finetune.py"
TEXT = (
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. "
    "Rough winds do shake the darling buds of May, and summer's lease hath all too short a date. "
) * 16


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    model = write_tiny_lm(tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    return model, text


def test_the_example_trains_a_lora_adapter_at_zero3(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, text = _setup(tmp_path)
    out = tmp_path / "out"
    args = ["--model", str(model), "--text", str(text), "--out", str(out), "--stage", "3"]
    args += ["--lora", "4", "--seq", "32", "--max-steps", "2"]
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    final = out / "final"
    assert (final / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with warnings.catch_warnings():  # peft 0.21 reads a property transformers 5 deprecates
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        tuned = PeftModel.from_pretrained(base, final)
    # LoRA's B starts at zero: a trained adapter has moved it
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in tuned.named_parameters())


@pytest.mark.slow(
    reason="2 fresh ranks through z launch; test_the_example_trains_a_lora_adapter_at_zero3 "
    "runs the same script on one rank"
)
def test_the_example_fine_tunes_fully_on_two_ranks(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, text = _setup(tmp_path)
    out = tmp_path / "out"
    args = ["--model", str(model), "--text", str(text), "--out", str(out), "--stage", "2"]
    run_z("launch", "--nproc", "2", str(EXAMPLE), *args, "--seq", "32", timeout=600)
    tuned = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    before = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    moved = [
        n
        for (n, p), q in zip(tuned.named_parameters(), before.parameters(), strict=True)
        if not torch.equal(p, q)
    ]
    assert moved, "no weight changed"
