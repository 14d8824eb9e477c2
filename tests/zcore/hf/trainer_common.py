"""Shared setup for zcore.hf.Trainer's tests: a tiny random LLaMA on disk, a fixed token
dataset, TrainingArguments, the plain single-process transformers Trainer as the baseline, and
the rank function that runs zcore.hf.Trainer on gloo ranks.

Every run logs each optimizer step (``logging_steps=1``): the per-step mean loss over all
ranks, the gradient norm (before clipping) and the learning rate the step used, read back from
``trainer.state.log_history``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB, SEQ, MB, GAS, WORLD = 128, 16, 2, 2, 2
LR, CLIP = 3e-3, 0.5  # CLIP is below the tiny model's gradient norms: every step is clipped


def write_model(out: Path) -> Path:
    """The tiny LLaMA (2 layers, hidden 64, vocab 128), written by transformers."""
    from tests.zserve.tiny_llama import tiny_llama

    tiny_llama(out)
    return out


def dataset(samples: int, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    """Fixed-length random token rows, labels = inputs (no padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def training_args(out: Path, micro: int, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    kwargs: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=GAS,
        learning_rate=LR,
        max_grad_norm=CLIP,
        weight_decay=0.01,
        warmup_steps=2,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_drop_last=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def history(trainer: Any) -> dict[str, list[float]]:
    """Per logged step: ``loss``, ``grad_norm``, ``learning_rate``."""
    logged = [e for e in trainer.state.log_history if "loss" in e]
    return {k: [float(e[k]) for e in logged] for k in ("loss", "grad_norm", "learning_rate")}


def plain_run(model_dir: Path, out: Path, samples: int, **overrides: Any) -> dict[str, Any]:
    """The baseline: transformers' Trainer in this process on the whole batch per micro-step."""
    from transformers import LlamaForCausalLM, Trainer

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = training_args(out, MB * WORLD, **overrides)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(samples))
    trainer.train()
    return {"history": history(trainer), "model": model}


def zero_config(stage: int, **extra: Any) -> dict[str, Any]:
    """A DeepSpeed-style config as a user would write it for the Trainer: "auto" everywhere
    TrainingArguments decides."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": "auto",
            "reduce_bucket_size": "auto",
        },
        "comm_timeout_s": 120,
        **extra,
    }


def zcore_trainer(rank: int, model_dir: str, out: str, stage: int, samples: int, **ov: Any) -> Any:
    """A zcore.hf.Trainer on this rank (stage 3: the model built partitioned)."""
    from transformers import LlamaForCausalLM

    import zcore.hf

    config = zero_config(stage)
    torch.manual_seed(0)
    if stage == 3:
        # the partitioner needs concrete values where the Trainer's config says "auto": the
        # persistence threshold "auto" is 10 x hidden size, as transformers fills it
        zero = {"stage": 3, "stage3_param_persistence_threshold": 10 * 64}
        init = {"train_batch_size": MB * GAS * WORLD, "zero_optimization": zero}
        model = zcore.hf.from_pretrained(LlamaForCausalLM, model_dir, ds_config=init)
    else:
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = training_args(Path(out), MB, **ov)
    return zcore.hf.Trainer(model=model, args=args, train_dataset=dataset(samples), config=config)


def train_rank(
    rank: int, world: int, model_dir: str, out: str, stage: int, samples: int, ov: dict[str, Any]
) -> dict[str, Any]:
    """Train with zcore.hf.Trainer; the log history (the same on every rank)."""
    trainer = zcore_trainer(rank, model_dir, out, stage, samples, **ov)
    trainer.train()
    return {"history": history(trainer)}
