"""Fine-tune a Hugging Face causal LM on a local text file with transformers' Trainer on zcore.

The script a DeepSpeed user already has, with one line changed: ``zcore.hf.Trainer`` in place of
``transformers.Trainer`` and the ZeRO config passed as ``config=`` instead of
``TrainingArguments(deepspeed=...)``. Full fine-tuning, or a LoRA adapter with ``--lora R``.

    z launch --nproc 2 examples/hf_finetune/finetune.py \\
        --model ~/.cache/zstack/models/SmolLM2-135M-Instruct --text my.txt --out runs/ft
    torchrun --nproc-per-node 2 examples/hf_finetune/finetune.py ... --stage 3 --lora 8

Without a launcher it runs as one rank. ``--out/final`` is a directory transformers loads
(``AutoModelForCausalLM.from_pretrained``), or with ``--lora`` an adapter directory
``PeftModel.from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainingArguments

import zcore.hf


def blocks(tokenizer: object, text: str, seq: int, whole: int) -> list[dict[str, torch.Tensor]]:
    """The text's tokens cut into ``seq``-token rows (labels = inputs), as many as make whole
    optimizer steps of ``whole`` rows (the ZeRO engine takes no partial accumulation)."""
    ids = torch.tensor(tokenizer(text)["input_ids"])  # type: ignore[operator]
    rows = ids[: len(ids) // seq * seq].view(-1, seq)
    rows = rows[: len(rows) // whole * whole]
    if not len(rows):
        raise SystemExit(
            f"the text has {len(ids)} tokens, fewer than one step of {whole} rows x {seq}"
        )
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="A Hugging Face causal-LM directory.")
    p.add_argument("--text", required=True, help="A plain text file to train on.")
    p.add_argument("--out", required=True, help="Output directory (checkpoints, final).")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage.")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning).")
    p.add_argument("--seq", type=int, default=128, help="Tokens per training row.")
    p.add_argument("--micro-batch", type=int, default=2, help="Rows per rank per micro-step.")
    p.add_argument("--accumulation", type=int, default=2, help="Micro-steps per step.")
    p.add_argument("--max-steps", type=int, default=-1, help="Stop after N steps (-1: 1 epoch).")
    p.add_argument("--lr", type=float, default=2e-5, help="Peak learning rate (x10 with --lora).")
    a = p.parse_args()

    args = TrainingArguments(
        output_dir=a.out,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.accumulation,
        learning_rate=a.lr * (10 if a.lora else 1),
        num_train_epochs=1,
        max_steps=a.max_steps,
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True,
        seed=0,
    )
    # a ds_config as DeepSpeed users write it for the Trainer: "auto" where TrainingArguments decide
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": a.stage, "stage3_param_persistence_threshold": "auto"},
    }
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    if a.stage == 3:  # built partitioned: no rank ever holds the whole model
        model_config = AutoConfig.from_pretrained(a.model)
        init = zcore.hf.init_config(config, args, hidden_size=model_config.hidden_size)
        model = zcore.hf.from_pretrained(
            AutoModelForCausalLM, a.model, ds_config=init, config=model_config
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    if a.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(task_type="CAUSAL_LM", r=a.lora, lora_alpha=2 * a.lora)
        model = get_peft_model(model, lora)
    step_rows = a.micro_batch * a.accumulation * args.world_size
    data = blocks(tokenizer, Path(a.text).read_text(), a.seq, step_rows)
    trainer = zcore.hf.Trainer(
        model=model, args=args, train_dataset=data, processing_class=tokenizer, config=config
    )
    trainer.train()
    trainer.save_model(f"{a.out}/final")  # every rank: the save is collective


if __name__ == "__main__":
    main()
