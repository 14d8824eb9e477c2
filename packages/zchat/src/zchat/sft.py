"""Supervised fine-tuning of a Hugging Face chat model under ZeRO-3, loss on answers only.

The model is built partitioned straight from its safetensors (``zcore.hf.from_pretrained``),
trained by a zcore engine with AdamW, and written back as a Hugging Face directory
(``zcore.hf.save_pretrained``). Each example is rendered with the model's own chat template;
the loss is the mean next-token cross-entropy over the answer tokens of the whole global
batch (normalised by the step's answer-token count, which every rank knows: see
:mod:`zchat.train_loop`), so the ZeRO-3 run's losses and updates equal a single-process run
on the same batches. The held-out metrics are the answer loss and the exact-match rate
under teacher forcing (every answer token is the argmax: exactly when greedy decoding would
write the reference answer).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from zchat.config import StageConfig
from zchat.data import (
    ChatData,
    SFTExample,
    build_chat_data,
    load_tokenizer,
    render_answer,
    require_nonempty,
)
from zchat.data.render import answer_batch, model_has_weights
from zchat.train_loop import (
    Recorder,
    all_sum,
    answer_ce_sum,
    causal_lm_class,
    ds_config,
    global_batches,
    heldout_shard,
    lr_factor,
    rank_micro_batches,
    scheduler_for,
)


class SFTConfig(StageConfig):
    """``z chat sft``. ``lr`` 2e-5 is zchat's (DeepSpeed-Chat's OPT scripts use 9.65e-6 over
    epochs; 2e-5 moves SmolLM2-135M within tens of steps)."""

    lr: float = 2e-5


Plays = list[tuple[str, str]] | None


def build_stage_data(cfg: StageConfig, plays: tuple[Plays, Plays] = (None, None)) -> ChatData:
    """The stage's data from its config (``plays``: zstack's train/held-out plays, for the
    Shakespeare task)."""
    return build_chat_data(
        cfg.task,
        train=cfg.train_examples,
        heldout=cfg.heldout_examples,
        seed=cfg.data_seed,
        train_plays=plays[0],
        heldout_plays=plays[1],
    )


def check_model_dir(path: str, key: str = "model") -> None:
    """Fail before any rank starts when ``path`` has no weights or no chat template."""
    if not model_has_weights(path):
        raise FileNotFoundError(
            f"`{key}` `{path}` has no model.safetensors; pass a Hugging Face model directory "
            "(`make models` fetches SmolLM2-135M-Instruct to ~/.cache/zstack/models)"
        )
    load_tokenizer(path)  # raises ChatTemplateError naming the model


def prepare_sft(cfg: SFTConfig, plays: tuple[Plays, Plays] = (None, None)) -> ChatData:
    """Every check that can fail before ranks start: weights, chat template, non-empty splits."""
    check_model_dir(cfg.model)
    data = build_stage_data(cfg, plays)
    require_nonempty(data.sft_train, "sft_train", "raise `train_examples`")
    require_nonempty(data.sft_heldout, "sft_heldout", "raise `heldout_examples`")
    return data


def evaluate_answers(
    model: Any, tokenizer: Any, examples: list[SFTExample], cfg: StageConfig, rank: int, world: int
) -> dict[str, float]:
    """Held-out answer loss (token mean) and teacher-forced exact match, over all ranks."""
    ce = tokens = exact = counted = 0.0
    model.eval()
    with torch.no_grad():
        for batch in heldout_shard(examples, rank, world, cfg.eval_batch):
            b = answer_batch(tokenizer, [(e.messages, e.answer) for e, _ in batch], cfg.max_len)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            target = b["labels"][:, 1:]
            mask = target != -100
            hit = (logits[:, :-1].argmax(-1) == target) | ~mask
            for i, (_, keep) in enumerate(batch):
                if keep:
                    ce += float(answer_ce_sum(logits[i : i + 1], b["labels"][i : i + 1]))
                    tokens += float(mask[i].sum())
                    exact += float(hit[i].all())
                    counted += 1
    ce, tokens, exact, counted = all_sum(ce, tokens, exact, counted)
    return {"loss": ce / max(tokens, 1.0), "exact_match": exact / max(counted, 1.0)}


def answer_tokens(tokenizer: Any, items: list[SFTExample], max_len: int) -> int:
    """Answer tokens the loss covers over ``items`` (labels after the first position)."""
    return sum(
        sum(1 for x in render_answer(tokenizer, e.messages, e.answer, max_len)[1][1:] if x != -100)
        for e in items
    )


def train_sft(
    rank: int, world: int, cfg: SFTConfig, plays: tuple[Plays, Plays] = (None, None)
) -> dict[str, Any]:
    """One rank of ``z chat sft`` (collective): train, evaluate before/after, save ``cfg.out``."""
    import zcore
    import zcore.hf

    start = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    data = build_stage_data(cfg, plays)
    ds = ds_config(cfg, world)
    model = zcore.hf.from_pretrained(causal_lm_class(cfg.model), cfg.model, ds_config=ds)
    engine, *_ = zcore.initialize(model, config=ds, lr_scheduler=scheduler_for(cfg))
    loaded = time.perf_counter() - start
    rec = Recorder("sft", cfg.out, cfg.steps, rank)
    before = evaluate_answers(engine, tokenizer, data.sft_heldout, cfg, rank, world)
    rec.write({"stage": "sft", "step": 0, **{f"heldout_{k}": v for k, v in before.items()}})
    per_step = cfg.micro_batch * cfg.grad_accum * world
    losses = []
    train_start = time.perf_counter()
    for step, batch in enumerate(global_batches(data.sft_train, per_step, cfg.steps, cfg.seed), 1):
        total = answer_tokens(tokenizer, batch, cfg.max_len)
        engine.train()
        ce_sum = seen = 0.0
        for micro in rank_micro_batches(batch, rank, world, cfg.micro_batch):
            b = answer_batch(tokenizer, [(e.messages, e.answer) for e in micro], cfg.max_len)
            logits = engine(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            ce = answer_ce_sum(logits, b["labels"])
            # the global token mean once ZeRO averages over ranks and accumulation steps
            engine.backward(ce * (world * cfg.grad_accum / total))
            engine.step()
            ce_sum += float(ce.detach())
            seen += float(b["attention_mask"].sum())
        ce_all, seen_all = all_sum(ce_sum, seen)
        losses.append(ce_all / total)
        if step % cfg.log_every == 0 or step == cfg.steps:
            rec.step(step, int(seen_all), loss=losses[-1], lr=cfg.lr * lr_factor(cfg, step - 1))
    train_s = time.perf_counter() - train_start
    after = evaluate_answers(engine, tokenizer, data.sft_heldout, cfg, rank, world)
    rec.write({"stage": "sft", "step": cfg.steps, **{f"heldout_{k}": v for k, v in after.items()}})
    out = zcore.hf.save_pretrained(engine, cfg.out, tokenizer_from=cfg.model)
    engine.destroy()
    return {
        "losses": losses,
        "heldout_before": before,
        "heldout_after": after,
        "out": str(Path(out)),
        "metrics": str(rec.path),
        "load_s": loaded,
        "train_s": train_s,
        "total_s": time.perf_counter() - start,
    }
