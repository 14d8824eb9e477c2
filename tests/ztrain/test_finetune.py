"""`z finetune`'s library (`ztrain.finetune*`): a tiny random LLaMA with SmolLM2's tokenizer
and chat template, fine-tuned on a few JSONL lines of text and chat messages on real gloo
ranks; the output directory loads in plain transformers (and the adapter in PEFT) and
generates what the trained model generates."""

from __future__ import annotations

import json
import subprocess
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


def _run_rank(rank: int, world: int, plan: FinetunePlan, serve: bool = True) -> dict[str, Any]:
    """Fine-tune on this rank; rank 0 then loads `final/` in transformers (and with `serve` in
    zserve's engine, what `z serve` runs) and generates greedily; with LoRA also the largest
    logit difference between the adapter over the base (PEFT) and the merged `final/`."""
    from ztrain.finetune import run

    run(plan, echo=lambda s: None)
    if rank != 0:
        return {}
    if serve:
        ids, served = _served(plan.final)
    else:
        from transformers import AutoTokenizer

        ids, served = AutoTokenizer.from_pretrained(plan.final)(PROMPT)["input_ids"], None
    out: dict[str, Any] = {"served": served, "greedy": _greedy(plan.final, ids)}
    if plan.options.lora:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(plan.options.model_dir, dtype=torch.float32)
        with peft_quietly():
            tuned = PeftModel.from_pretrained(base, plan.adapter).eval()
        merged = AutoModelForCausalLM.from_pretrained(plan.final, dtype=torch.float32).eval()
        probe = torch.tensor([ids])
        with torch.no_grad():
            out["merge_diff"] = float((merged(probe).logits - tuned(probe).logits).abs().max())
    return out


def _greedy(model_dir: Path, prompt: list[int] | None = None) -> list[int]:
    """transformers' greedy 5 tokens after `prompt` (default: PROMPT, tokenized)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if prompt is None:
        prompt = AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


def _served(model_dir: Path) -> tuple[list[int], list[int]]:
    """(PROMPT's ids, the greedy 5 tokens) from zserve's engine (what `z serve` runs)."""
    from zserve.engine import Engine
    from zserve.sampling import SamplingParams

    engine = Engine(model_dir, max_model_len=64, token_budget=64, max_num_seqs=1)
    ids = engine.tokenizer.encode(PROMPT)
    engine.add_request("r", ids, SamplingParams(max_tokens=5, temperature=0))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
    return ids, tokens


def _changed(a: Path, b: Path) -> list[str]:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return [k for k in x if not torch.equal(x[k], y[k])]


def test_full_finetune_writes_a_model_transformers_loads(tmp_path: Path) -> None:
    model, data = _setup(tmp_path)
    out = tmp_path / "run"
    opts = FinetuneOptions(model, data, out=out, seq_len=24, epochs=1.0, lr=1e-3)
    plan = plan_finetune(opts, world_size=1)
    # (zserve loads final/ in the LoRA case and the slow two-rank CLI case)
    [got] = run_ranks(_run_rank, 1, args=(plan, False), timeout=120)
    assert len(got["greedy"]) == 5, got
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
    model, data = _setup(tmp_path)
    config = write_json(tmp_path / "ds.json", {"zero_optimization": {"stage": 3}})
    out = tmp_path / "run"
    opts = FinetuneOptions(model, data, config=config, out=out, lora=4, seq_len=24, lr=1e-2)
    plan = plan_finetune(opts, world_size=1)
    [got] = run_ranks(_run_rank, 1, args=(plan,), timeout=120)
    assert got["merge_diff"] < 1e-4 and got["served"] == got["greedy"], got
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    # only the adapted projections of the base moved (the adapter merged into them)
    changed = _changed(model, out / "final")
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed), changed


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
    with pytest.raises(FinetuneError, match=r"--base-bits 4: .* needs --lora R"):
        plan_finetune(FinetuneOptions(model, data, base_bits=4), 1)
    with pytest.raises(FinetuneError, match="4 examples, fewer than one optimizer step of 8"):
        plan_finetune(FinetuneOptions(model, data, micro_batch=4), 2)
    with pytest.raises(FinetuneError, match="--eval-every 2 needs --eval-data"):
        plan_finetune(FinetuneOptions(model, data, eval_every=2), 1)
    small = write_data(tmp_path / "small.jsonl", LINES[:1])
    with pytest.raises(FinetuneError, match="1 examples, fewer than one evaluation batch of 2"):
        plan_finetune(FinetuneOptions(model, data, eval_data=small), 2)
    with pytest.raises(FinetuneError, match=r"--resume: no checkpoint-N folder in .*--save-every"):
        plan_finetune(FinetuneOptions(model, data, out=tmp_path / "new", resume=True), 1)


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _eval_and_resume_rank(rank: int, world: int, model: Path, data: Path, tmp: Path) -> None:
    """A 4-step run evaluating and saving every 2 steps; then a copy of its directory without
    its last checkpoint (as if it stopped after step 2), resumed."""
    import shutil

    from ztrain.finetune import run

    common = dict(seq_len=24, lr=1e-3, eval_data=data, eval_every=2, save_every=2)
    run(plan_finetune(FinetuneOptions(model, data, out=tmp / "a", **common), 1), lambda s: None)
    shutil.copytree(tmp / "a", tmp / "b", symlinks=True)
    shutil.rmtree(tmp / "b" / "checkpoints" / "checkpoint-4")
    plan = plan_finetune(FinetuneOptions(model, data, out=tmp / "b", resume=True, **common), 1)
    assert plan.resume_from == tmp / "b" / "checkpoints" / "checkpoint-2"
    run(plan, lambda s: None)


def test_eval_data_and_resume_give_the_uninterrupted_run(tmp_path: Path) -> None:
    """--eval-data records eval_loss every --eval-every steps and at the end; --resume from
    checkpoint-2 gives the uninterrupted run's losses (rel 1e-6) and final weights (atol
    1e-6), and metrics.jsonl holds each step once."""
    from safetensors.torch import load_file

    model, data = _setup(tmp_path)
    run_ranks(_eval_and_resume_rank, 1, args=(model, data, tmp_path), timeout=180)
    full, resumed = _records(tmp_path / "a"), _records(tmp_path / "b")
    assert [r["step"] for r in full] == [1, 2, 2, 3, 4, 4, 4]  # evals at 2, 4 and the end
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for a, b in zip(full, resumed, strict=True):
        key = "loss" if "loss" in a else "eval_loss"
        assert b[key] == pytest.approx(a[key], rel=1e-6), (a, b)
    evals = [r["eval_loss"] for r in full if "eval_loss" in r]
    assert evals[1] == pytest.approx(evals[2], rel=1e-6) and evals[0] != evals[1]
    x, y = (
        load_file(str(tmp_path / "a/final/model.safetensors")),
        load_file(str(tmp_path / "b/final/model.safetensors")),
    )
    for k in x:
        torch.testing.assert_close(y[k], x[k], rtol=0, atol=1e-6)


@pytest.mark.slow(reason="QLoRA through z finetune's run; test_finetune_qlora checks its math")
def test_lora_over_an_int4_base_merges_into_the_full_precision_model(tmp_path: Path) -> None:
    model, data = _setup(tmp_path)
    out = tmp_path / "run"
    opts = FinetuneOptions(model, data, out=out, lora=4, base_bits=4, seq_len=24, lr=1e-2)
    [got] = run_ranks(_run_rank, 1, args=(plan_finetune(opts, 1),), timeout=300)
    assert got["merge_diff"] < 1e-4 and got["served"] == got["greedy"], got
    changed = _changed(model, out / "final")
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed), changed


@pytest.mark.slow(
    reason="`z finetune --nproc 2` (two fresh ranks through z launch), resumed on 1 rank (~90 s)"
)
def test_cli_on_two_ranks_at_zero3_writes_a_model_that_generates(tmp_path: Path) -> None:
    """Two ranks at ZeRO-3 with --eval-data and a checkpoint per step; the run's directory
    without its last checkpoint, resumed with --resume on ONE rank, gives the step-2 loss and
    the eval loss of the two-rank run (rel 1e-5: another reduction order)."""
    import shutil

    from tests.utils.cli import run_z

    model, data = _setup(tmp_path)
    config = write_json(tmp_path / "ds.json", {"zero_optimization": {"stage": 3}})
    out = tmp_path / "run"
    args = ["--config", str(config), "--seq-len", "24", "--lr", "1e-3", "--eval-data", str(data)]
    args += ["--save-every", "1"]
    two = ["--nproc", "2", "--micro-batch", "1", "--out", str(out)]
    done = run_z("finetune", str(model), str(data), *args, *two, timeout=600)
    assert "2 rank(s), ZeRO stage 3" in done.stdout and "done: 2 steps" in done.stdout
    assert "eval loss" in done.stdout
    records = _records(out)
    assert [len(r["rank_rss_mib"]) for r in records if "loss" in r] == [2, 2]
    assert _changed(model, out / "final")
    again = tmp_path / "again"
    shutil.copytree(out, again, symlinks=True)
    shutil.rmtree(again / "checkpoints" / "checkpoint-2")
    one = ["--micro-batch", "2", "--resume", "--out", str(again)]  # the same rows per step
    done = run_z("finetune", str(model), str(data), *args, *one, timeout=600)
    assert "1 rank(s)" in done.stdout and "resuming after step 1" in done.stdout, done.stdout
    resumed = _records(again)
    assert [r["step"] for r in resumed] == [r["step"] for r in records]
    for a, b in zip(records, resumed, strict=True):
        key = "loss" if "loss" in a else "eval_loss"
        assert b[key] == pytest.approx(a[key], rel=1e-5), (a, b)


def test_the_cli_names_a_bad_line_and_exits_2(tmp_path: Path) -> None:
    from tests.utils.cli import Z

    model = write_tiny_lm(tmp_path / "tiny")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(LINES[0]) + "\n" + '{"text": 3}\n')
    done = subprocess.run(
        [str(Z), "finetune", str(model), str(bad)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert 'bad.jsonl` line 2: "text" must be a non-empty string' in done.stderr, done.stderr
