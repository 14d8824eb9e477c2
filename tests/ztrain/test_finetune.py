"""`z finetune`'s library (`ztrain.finetune*`): a tiny random LLaMA with SmolLM2's tokenizer
and chat template, fine-tuned on a few JSONL lines of text and chat messages on real gloo
ranks; the output directory loads in plain transformers (and the adapter in PEFT) and
generates what the trained model generates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.distributed import run_ranks
from tests.utils.tiny_lm import write_tiny_lm
from tests.zcore.hf.trainer_common import peft_quietly
from ztrain.finetune_plan import FinetuneOptions, FinetunePlan, plan_finetune

LINES: list[dict[str, Any]] = [
    {"text": "Shall I compare thee to a summer's day? Thou art more lovely."},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    {"text": "Rough winds do shake the darling buds of May."},
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
]
PROMPT = "Shall I compare"


def write_data(path: Path, lines: list[dict[str, Any]] = LINES) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    return write_tiny_lm(tmp_path / "tiny"), write_data(tmp_path / "data.jsonl")


def _run_rank(rank: int, world: int, plan: FinetunePlan) -> list[int]:
    """Fine-tune on this rank; the trained model's greedy tokens for PROMPT (the base merged
    with the adapter's weights, read back by every rank after the run)."""
    from ztrain.finetune import run

    run(plan, echo=lambda s: None)
    return _greedy(plan.final)


def _greedy(model_dir: Path) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    return out[0, ids["input_ids"].shape[1] :].tolist()


def _changed(a: Path, b: Path) -> list[str]:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return [k for k in x if not torch.equal(x[k], y[k])]


def test_full_finetune_writes_a_model_transformers_loads(tmp_path: Path) -> None:
    model, data = _setup(tmp_path)
    out = tmp_path / "run"
    opts = FinetuneOptions(model, data, out=out, seq_len=24, epochs=1.0, lr=1e-3)
    plan = plan_finetune(opts, world_size=1)
    [greedy] = run_ranks(_run_rank, 1, args=(plan,), timeout=120)
    assert len(greedy) == 5
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(
        r["loss"] > 0 and r["tokens_per_s"] > 0 and len(r["rank_rss_mib"]) == 1 for r in records
    )
    assert (out / "loss.png").stat().st_size > 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in (out / "final").iterdir()
    }
    assert _changed(model, out / "final"), "no weight moved"


def test_lora_at_zero3_saves_the_adapter_and_a_merged_model(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, data = _setup(tmp_path)
    config = write_json(tmp_path / "ds.json", {"zero_optimization": {"stage": 3}})
    out = tmp_path / "run"
    opts = FinetuneOptions(model, data, config=config, out=out, lora=4, seq_len=24, lr=1e-2)
    plan = plan_finetune(opts, world_size=1)
    [greedy] = run_ranks(_run_rank, 1, args=(plan,), timeout=120)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with peft_quietly():
        tuned = PeftModel.from_pretrained(base, out / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 3, 99, 42]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, tuned(ids).logits, rtol=0, atol=1e-4)
    assert greedy == _greedy(out / "final")
    # the base's own weights are unchanged outside the adapted projections
    assert all("q_proj" in k or "v_proj" in k for k in _changed(model, out / "final"))


def write_json(path: Path, value: Any) -> Path:
    path.write_text(json.dumps(value))
    return path


def test_bad_input_is_named_before_training(tmp_path: Path) -> None:
    from ztrain.finetune_data import FinetuneError

    model, data = _setup(tmp_path)
    with pytest.raises(FinetuneError, match=r"missing\.jsonl` does not exist"):
        plan_finetune(FinetuneOptions(model, tmp_path / "missing.jsonl"), 1)
    with pytest.raises(FinetuneError, match=r"no config\.json"):
        plan_finetune(FinetuneOptions(tmp_path, data), 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(LINES[0]) + "\n\n{not json\n")
    with pytest.raises(FinetuneError, match=r"bad\.jsonl` line 3: not valid JSON"):
        plan_finetune(FinetuneOptions(model, bad), 1)
    write_data(bad, [LINES[0], {"prompt": "x"}])
    with pytest.raises(FinetuneError, match=r"line 2: has keys \['prompt'\]"):
        plan_finetune(FinetuneOptions(model, bad), 1)
    unknown = write_json(tmp_path / "ds.json", {"zero_optimization": {"stage": 2}, "zero_stage": 2})
    with pytest.raises(ValueError, match="unknown key zero_stage"):
        plan_finetune(FinetuneOptions(model, data, config=unknown), 1)
    conflict = write_json(tmp_path / "ds2.json", {"train_micro_batch_size_per_gpu": 2})
    with pytest.raises(ValueError, match="config train_micro_batch_size_per_gpu=2 vs"):
        plan_finetune(FinetuneOptions(model, data, config=conflict, micro_batch=1), 1)
    with pytest.raises(FinetuneError, match="4 examples, fewer than one optimizer step of 8"):
        plan_finetune(FinetuneOptions(model, data, micro_batch=4), 2)
