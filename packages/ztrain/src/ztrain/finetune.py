"""`z finetune`: a user's Hugging Face causal LM on a local JSONL, through `zcore.hf.Trainer`.

Every rank runs :func:`run` on the same :class:`~ztrain.finetune_plan.FinetunePlan`. The run
directory (`--out`) holds::

    metrics.jsonl     one record per optimizer step (rank 0; `ztrain.finetune_log`)
    loss.png          the train loss against step
    checkpoints/      the Trainer's `checkpoint-N` folders (with `--save-every`)
    final/            the model: `AutoModelForCausalLM.from_pretrained` and `z serve` load it
    adapter/          with `--lora`: the adapter, which `PeftModel.from_pretrained` loads

At ZeRO stage 3 the model is built partitioned (`zcore.hf.from_pretrained`: no rank holds it
whole). With `--lora R` a `peft` LoRA adapter (rank R, alpha 2R, peft's default target
modules for the architecture) trains over the frozen base; the Trainer saves the adapter, and
rank 0 then loads the base from `MODEL_DIR` in plain transformers, merges the adapter into it
(`merge_and_unload`) and writes `final/`, so `final/` is one self-contained model either way.
With `--base-bits 8|4` as well, the frozen base trains stored as packed INT8/INT4
(`ztrain.finetune_qlora`); the adapter is still merged into the full-precision base.

`--tp T` (the config's `tensor_parallel.autotp_size`) cuts a LLaMA/Mistral/Qwen2 model's
layers over T ranks (`zcore.tensor`'s `llama` plan, through `zcore.hf.Trainer`); the T ranks of
one data rank read the same examples, so `--nproc` is T x the data-parallel ranks; `final/` is
the whole model, gathered.

`--eval-data FILE` is evaluated (mean loss over whole batches of every rank) every
`--eval-every` steps and once after training; `--resume` continues from the latest
`checkpoint-N` in `checkpoints/` (the Trainer's resume: weights, optimizer, schedule, data
position and RNG; any world size with the same rows per step), keeping the metrics records
up to that step.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from ztrain.finetune_data import FinetuneError, read_examples, to_rows
from ztrain.finetune_log import FinetuneLog
from ztrain.finetune_plan import FinetunePlan, total_steps


def training_arguments(plan: FinetunePlan) -> TrainingArguments:
    """The Trainer's arguments: the plan's numbers, one log record per step."""
    a, o = plan.args, plan.options
    save = dict(save_strategy="steps", save_steps=o.save_every) if o.save_every else {}
    evaluate = dict(eval_strategy="steps", eval_steps=o.eval_every) if o.eval_every else {}
    return TrainingArguments(
        output_dir=str(plan.out / "checkpoints"),
        per_device_train_batch_size=a.per_device_train_batch_size,
        per_device_eval_batch_size=a.per_device_train_batch_size,
        gradient_accumulation_steps=a.gradient_accumulation_steps,
        learning_rate=a.learning_rate,
        max_grad_norm=a.max_grad_norm,
        adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2,
        adam_epsilon=a.adam_epsilon,
        weight_decay=a.weight_decay,
        warmup_steps=a.warmup_steps,
        lr_scheduler_type="linear",
        num_train_epochs=o.epochs,
        max_steps=plan.max_steps,
        bf16=a.bf16,
        fp16=a.fp16,
        logging_steps=1,
        save_strategy=save.get("save_strategy", "no"),
        save_steps=save.get("save_steps", 500),
        eval_strategy=evaluate.get("eval_strategy", "no"),
        eval_steps=evaluate.get("eval_steps"),
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True,
        disable_tqdm=True,
        include_num_input_tokens_seen="non_padding",
        seed=o.seed,
    )


def build_model(plan: FinetunePlan, args: TrainingArguments) -> Any:
    """The model, partitioned at stage 3, with the LoRA adapter when asked (over a packed
    INT8/INT4 base with `base_bits`: built whole, see `ztrain.finetune_qlora`). With `--tp`
    it is built whole on every rank: the Trainer cuts it over `tp` when training starts, and
    stage 3 then partitions each rank's shards."""
    import zcore.hf

    model_dir = str(plan.options.model_dir)
    torch.manual_seed(plan.options.seed)
    if plan.stage == 3 and not plan.options.base_bits and plan.tp == 1:
        config = AutoConfig.from_pretrained(model_dir)
        init = zcore.hf.init_config(plan.config, args, hidden_size=config.hidden_size)
        model = zcore.hf.from_pretrained(
            AutoModelForCausalLM, model_dir, ds_config=init, config=config
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if plan.options.lora:
        from peft import LoraConfig, get_peft_model

        r = plan.options.lora
        lora = LoraConfig(task_type="CAUSAL_LM", r=r, lora_alpha=2 * r, lora_dropout=0.0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
            model = get_peft_model(model, lora)
    if plan.options.base_bits:  # QLoRA-style: the frozen base packed, the adapter fp32
        from ztrain.finetune_qlora import quantize_frozen_base

        quantize_frozen_base(model, plan.options.base_bits)
    return model


def merge_adapter(model_dir: Path, adapter: Path, out: Path, tokenizer: Any) -> Path:
    """Write `out`: the base model of `model_dir` with the adapter merged in (one process)."""
    from peft import PeftModel

    from ztrain.atomic_dir import write_dir_atomically

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with warnings.catch_warnings():  # peft reads a property transformers 5 deprecates
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()

    def fill(tmp: Path) -> None:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_dir_atomically(out, fill)


def run(plan: FinetunePlan, echo: Callable[[str], None] = print) -> int:
    """Fine-tune on this rank (every rank of the job calls it); returns the exit code."""
    from transformers import PrinterCallback

    import zcore.hf
    from ztrain.metrics import plot_loss_curve

    t_start = time.perf_counter()
    o = plan.options
    args = training_arguments(plan)
    rank0 = args.process_index == 0
    tokenizer = AutoTokenizer.from_pretrained(str(o.model_dir))
    rows = to_rows(read_examples(o.data), tokenizer, o.seq_len)
    whole = len(rows.rows) // plan.step_rows * plan.step_rows
    model = build_model(plan, args)
    trainable = sum(
        torch.Size(getattr(p, "z_shape", p.shape)).numel()  # a stage-3 parameter's full size
        for p in model.parameters()
        if p.requires_grad
    )
    eval_rows = None
    if o.eval_data is not None:
        eval_rows = to_rows(read_examples(o.eval_data), tokenizer, o.seq_len).rows
        eval_rows = eval_rows[: plan.eval_examples]
    resumed_at = int(plan.resume_from.name.split("-", 1)[1]) if plan.resume_from else 0
    log = FinetuneLog(plan.metrics, rank0=rank0, keep_through=resumed_at)
    trainer = zcore.hf.Trainer(
        model=model,
        args=args,
        train_dataset=rows.rows[:whole],
        eval_dataset=eval_rows,
        processing_class=tokenizer,
        config=plan.config,
        callbacks=[log],
    )
    trainer.remove_callback(PrinterCallback)  # the progress line says it
    if rank0:
        for note in plan.notes:
            echo(f"note: {note}")
        if rows.truncated:
            echo(f"note: {rows.truncated} examples are longer than --seq-len {o.seq_len}; cut")
        what = f"LoRA r={o.lora}, {trainable:,} trainable parameters" if o.lora else "full"
        if o.base_bits:
            what += f", INT{o.base_bits} frozen base"
        echo(
            f"fine-tuning {o.model_dir.name} ({what}) on {whole} examples of `{o.data}` "
            f"({rows.tokens:,} tokens), {args.world_size} rank(s)"
            + (f" (tp {plan.tp} x dp {plan.data_parallel})" if plan.tp > 1 else "")
            + f", ZeRO stage {plan.stage}: "
            f"{total_steps(plan)} steps of {plan.step_rows} x {o.seq_len} tokens"
            + (f", resuming after step {resumed_at} (`{plan.resume_from}`)" if resumed_at else "")
        )
    resume = str(plan.resume_from) if plan.resume_from else None
    try:
        trainer.train(resume_from_checkpoint=resume)
        eval_loss = trainer.evaluate()["eval_loss"] if eval_rows else None  # collective
    finally:
        log.close()
    if o.lora:
        trainer.save_model(str(plan.adapter))  # collective
        if rank0:
            merge_adapter(o.model_dir, plan.adapter, plan.final, tokenizer)
        if dist.is_initialized():
            dist.barrier()
    else:
        trainer.save_model(str(plan.final))  # collective
    if rank0:
        png = plot_loss_curve(plan.metrics, plan.out / "loss.png", f"{o.model_dir.name} fine-tune")
        last = f"{log.last_loss:.4f}" if log.last_loss is not None else "-"
        adapter = f"  adapter     {plan.adapter}\n" if o.lora else ""
        held = f", eval loss {eval_loss:.4f}" if eval_loss is not None else ""
        echo(
            f"done: {trainer.state.global_step} steps in {time.perf_counter() - t_start:.0f} s, "
            f"final loss {last}{held}\n  metrics     {plan.metrics}\n  loss curve  {png}\n"
            f"{adapter}  model       {plan.final}"
            + (" (the adapter merged into the base)" if o.lora else "")
            + f"\nnext: `z serve {plan.final}`"
        )
    return 0


__all__ = ["FinetuneError", "build_model", "merge_adapter", "run", "training_arguments"]
