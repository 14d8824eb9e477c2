"""Shared setup for zcore.hf.Trainer's tests: a tiny random LLaMA on disk, a fixed token
dataset, TrainingArguments, the plain single-process transformers Trainer as the baseline, and
the rank function that runs zcore.hf.Trainer on gloo ranks.

Every run logs each optimizer step (``logging_steps=1``): the per-step mean loss over all
ranks, the gradient norm (before clipping) and the learning rate the step used, read back from
``trainer.state.log_history``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
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
        per_device_eval_batch_size=micro,  # whole eval batches on every rank (drop_last)
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
    """Per logged step: ``loss``, ``grad_norm``, ``learning_rate``; per evaluation
    ``eval_loss``."""
    logged = [e for e in trainer.state.log_history if "loss" in e]
    out = {k: [float(e[k]) for e in logged] for k in ("loss", "grad_norm", "learning_rate")}
    out["eval_loss"] = [
        float(e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e
    ]
    return out


def eval_set() -> list[dict[str, torch.Tensor]]:
    return dataset(2 * MB * WORLD, seed=9)


PROBE = [5, 17, 3, 99, 42]
NEW_TOKENS = 6


def greedy(model: Any) -> list[int]:
    """``model``'s greedy continuation of :data:`PROBE` (collective at stage 3)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROBE]),
            attention_mask=torch.ones(1, len(PROBE), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return out[0, len(PROBE) :].tolist()


def greedy_at_evaluate() -> Any:
    """A Trainer callback that generates greedily inside ``on_evaluate`` (during training)
    and keeps the tokens in ``.tokens``."""
    from transformers import TrainerCallback

    class GreedyAtEvaluate(TrainerCallback):
        def __init__(self) -> None:
            self.tokens: list[list[int]] = []

        def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            model = kw["model"]
            was_training = model.training
            model.eval()
            self.tokens.append(greedy(model))
            model.train(was_training)

    return GreedyAtEvaluate()


def plain_run(model_dir: Path, out: Path, samples: int, **overrides: Any) -> dict[str, Any]:
    """The baseline: transformers' Trainer in this process on the whole batch per micro-step."""
    from transformers import LlamaForCausalLM, Trainer

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = training_args(out, MB * WORLD, **overrides)
    recorder = greedy_at_evaluate()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset(samples),
        eval_dataset=eval_set(),
        callbacks=[recorder],
    )
    trainer.train()
    prediction = trainer.predict(eval_set())
    return {
        "history": history(trainer),
        "model": model,
        "greedy_at_eval": recorder.tokens,
        "flos": trainer.state.total_flos,
        "predict": (prediction.metrics["test_loss"], tuple(prediction.predictions.shape)),
    }


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


def zcore_trainer(
    world: int, model_dir: str, out: str, stage: int, samples: int, lora: bool = False, **ov: Any
) -> Any:
    """A zcore.hf.Trainer on this rank of ``world`` (stage 3: the model built partitioned),
    with :func:`with_lora`'s adapter if ``lora``. The global batch is the same at any world
    size: ``MB x WORLD / world`` per rank."""
    from transformers import LlamaForCausalLM

    import zcore.hf

    config = zero_config(stage)
    args = training_args(Path(out), MB * WORLD // world, **ov)
    torch.manual_seed(0)
    if stage == 3:  # built partitioned, with the Trainer's config ("auto" filled as it will be)
        init = zcore.hf.init_config(config, args, hidden_size=64)
        model = zcore.hf.from_pretrained(LlamaForCausalLM, model_dir, ds_config=init)
    else:
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        model = with_lora(model)
    return zcore.hf.Trainer(
        model=model,
        args=args,
        train_dataset=dataset(samples),
        eval_dataset=eval_set(),
        callbacks=[greedy_at_evaluate()],
        config=config,
    )


def recorded_greedy(trainer: Any) -> list[list[int]]:
    """What :func:`greedy_at_evaluate`'s callback recorded during training."""
    return next(c.tokens for c in trainer.callback_handler.callbacks if hasattr(c, "tokens"))


# -- LoRA ---------------------------------------------------------------------------------
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def with_lora(model: Any) -> Any:
    """``model`` with a LoRA adapter on the attention's q/v projections (seeded, so every
    rank and the baseline start from the same adapter)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    with peft_quietly():
        return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))


@contextlib.contextmanager
def peft_quietly() -> Iterator[None]:
    """peft 0.21 reads transformers 5's deprecated ``is_gradient_checkpointing`` when it wraps
    a model: that FutureWarning is theirs, not an error of the code under test."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        yield


def plain_lora_run(model_dir: Path, out: Path, samples: int, **overrides: Any) -> dict[str, Any]:
    """The baseline for LoRA: transformers' Trainer on the same adapter in this process."""
    from transformers import LlamaForCausalLM, Trainer

    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = with_lora(base)
    args = training_args(out, MB * WORLD, **overrides)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(samples))
    trainer.train()
    return {"history": history(trainer), "model": model}
