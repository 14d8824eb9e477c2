"""zchat.sft: the ZeRO-3 SFT run equals a plain single-process transformers + torch AdamW run
of the same steps, written here as the readable reference (chat template, cross-entropy
mean over the global batch's answer tokens, the same cosine schedule and clipping).

Tolerance: per-step losses rel 1e-5 (fp32; the sharded run sums gradients in another
order, as in tests/zcore/zero/test_hf_train.py); the saved directory's logits against the
reference model's after the same steps atol 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.utils.distributed import run_ranks
from tests.utils.tiny_lm import write_tiny_lm
from zchat.config import ChatConfigError, load_config
from zchat.data import EmptyDatasetError, answer_batch, load_tokenizer
from zchat.sft import SFTConfig, build_stage_data, prepare_sft, train_sft
from zchat.train_loop import global_batches, lr_factor

STEPS = 4


def config(tmp_path: Path, lm: Path, **extra: Any) -> SFTConfig:
    return load_config(
        SFTConfig,
        model=str(lm),
        out=str(tmp_path / "sft"),
        steps=STEPS,
        micro_batch=2,
        lr=1e-3,
        train_examples=32,
        heldout_examples=4,
        persistence_threshold=100,
        **extra,
    )


def reference(cfg: SFTConfig, world: int) -> tuple[list[float], Any]:
    """Plain transformers + torch AdamW on each whole global batch, one process."""
    from transformers import LlamaForCausalLM

    tok = load_tokenizer(cfg.model)
    model = LlamaForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    data = build_stage_data(cfg)
    per_step = cfg.micro_batch * cfg.grad_accum * world
    losses = []
    for batch in global_batches(data.sft_train, per_step, cfg.steps, cfg.seed):
        b = answer_batch(tok, [(e.messages, e.answer) for e in batch], cfg.max_len)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            b["labels"][:, 1:].reshape(-1),
            ignore_index=-100,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model.eval()


def check_against_reference(cfg: SFTConfig, results: list[dict[str, Any]], world: int) -> None:
    from transformers import LlamaForCausalLM

    ref_losses, ref = reference(cfg, world)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), (r["losses"], ref_losses)
    assert ref_losses[-1] < ref_losses[0]
    saved = LlamaForCausalLM.from_pretrained(cfg.out, dtype=torch.float32).eval()
    probe = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(saved(probe).logits, ref(probe).logits, rtol=0, atol=1e-4)
    records = [json.loads(line) for line in Path(results[0]["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert all(
        len(r["rss_bytes"]) == world and r["tokens_per_s"] > 0 for r in records if "loss" in r
    )
    after = results[0]["heldout_after"]
    assert after["loss"] < results[0]["heldout_before"]["loss"]


def test_sft_one_rank_zero3_equals_plain_adamw(tmp_path: Path) -> None:
    lm = write_tiny_lm(tmp_path / "lm")
    cfg = config(tmp_path, lm)
    prepare_sft(cfg)
    check_against_reference(cfg, [train_sft(0, 1, cfg)], world=1)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 2 ranks loading transformers on a busy 2-core machine
def test_sft_two_ranks_zero3_equals_plain_adamw(tmp_path: Path) -> None:
    lm = write_tiny_lm(tmp_path / "lm")
    cfg = config(tmp_path, lm, grad_accum=2)  # and across accumulation steps
    results = run_ranks(train_sft, 2, args=(cfg,), timeout=600)
    check_against_reference(cfg, results, world=2)


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ChatConfigError, match=r"unknown key `learning_rate` \(accepted: .*lr"):
        load_config(SFTConfig, model="m", out="o", learning_rate=1e-3)
    with pytest.raises(ChatConfigError, match="`steps` must be ≥ 1, got 0"):
        load_config(SFTConfig, model="m", out="o", steps=0)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "m", "out": "o", "task": "poems"}')
    with pytest.raises(ChatConfigError, match=rf"`{bad}`: `task`: Input should be"):
        load_config(SFTConfig, bad)
    with pytest.raises(FileNotFoundError, match=r"has no model\.safetensors"):
        prepare_sft(load_config(SFTConfig, model=str(tmp_path), out="o"))
    lm = write_tiny_lm(tmp_path / "lm")
    with pytest.raises(EmptyDatasetError, match="`sft_train` split is empty; raise `train_"):
        prepare_sft(load_config(SFTConfig, model=str(lm), out="o", train_examples=0))
