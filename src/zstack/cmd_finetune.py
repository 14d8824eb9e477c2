"""`z finetune MODEL_DIR DATA`: fine-tune a Hugging Face causal LM on a local JSONL file.

Imports only typer and the standard library at load time; the run is `ztrain.finetune`.
The options are checked once (`ztrain.finetune_plan.plan_finetune`: a bad model directory,
data line or config key fails here, before any rank starts); with `--nproc N` the command
starts itself again on N ranks through `z launch`'s torchrun, as `z train --nproc` does, and
each rank plans the same run and runs `ztrain.finetune.run`.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from zstack.relaunch import relaunch


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def finetune(
    ctx: typer.Context,
    model_dir: Path = typer.Argument(..., help="Hugging Face causal-LM directory."),
    data: Path = typer.Argument(
        ..., help='JSONL: one {"text": ...} or {"messages": [...]} object per line.'
    ),
    config: Path | None = typer.Option(
        None, "--config", help="DeepSpeed ds_config.json (default: ZeRO stage 2)."
    ),
    out: Path = typer.Option(Path("runs/finetune"), "--out", help="Run directory."),
    lora: int = typer.Option(0, "--lora", min=0, help="LoRA rank; 0: full fine-tuning."),
    base_bits: int = typer.Option(
        0, "--base-bits", help="With --lora: the frozen base as INT8 or INT4 (QLoRA-style)."
    ),
    nproc: int = typer.Option(1, "--nproc", min=1, help="Ranks on this machine (gloo on CPU)."),
    epochs: float = typer.Option(1.0, "--epochs", min=0.0, help="Passes over the data."),
    max_steps: int | None = typer.Option(
        None, "--max-steps", min=1, help="Stop after N optimizer steps (instead of --epochs)."
    ),
    seq_len: int = typer.Option(512, "--seq-len", min=2, help="Tokens per example (cut/padded)."),
    micro_batch: int | None = typer.Option(
        None,
        "--micro-batch",
        min=1,
        help="Examples per rank per micro-step (default: config or 1).",
    ),
    grad_accum: int | None = typer.Option(
        None, "--grad-accum", min=1, help="Micro-steps per optimizer step (default: config or 1)."
    ),
    lr: float | None = typer.Option(
        None, "--lr", min=0.0, help="Peak learning rate (default: config, or 2e-5; LoRA 2e-4)."
    ),
    seed: int = typer.Option(0, "--seed", min=0, help="LoRA init and data order."),
    save_every: int = typer.Option(
        0, "--save-every", min=0, help="Steps between `checkpoint-N` folders; 0: none."
    ),
    eval_data: Path | None = typer.Option(
        None, "--eval-data", help="JSONL like DATA: its mean loss at the end (and --eval-every)."
    ),
    eval_every: int = typer.Option(
        0, "--eval-every", min=0, help="Steps between evaluations of --eval-data; 0: at the end."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from OUT's latest checkpoint-N (any --nproc)."
    ),
    tp: int = typer.Option(
        1,
        "--tp",
        min=1,
        help="Tensor-parallel ranks each layer is cut over (LLaMA/Mistral/Qwen2); "
        "NPROC = tp x data-parallel ranks.",
    ),
) -> None:
    """Fine-tune MODEL_DIR on DATA with zcore's ZeRO (full or LoRA); writes OUT/final."""
    from zcore.config import ConfigError
    from ztrain.finetune_plan import FinetuneOptions, plan_finetune

    opts = FinetuneOptions(
        model_dir=model_dir,
        data=data,
        config=config,
        out=out,
        lora=lora,
        base_bits=base_bits,
        epochs=epochs,
        max_steps=max_steps,
        seq_len=seq_len,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        lr=lr,
        seed=seed,
        save_every=save_every,
        eval_data=eval_data,
        eval_every=eval_every,
        resume=resume,
        tp=tp,
    )
    under_launcher = "RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1")) if under_launcher else nproc
    try:
        plan = plan_finetune(opts, world)
    except (ConfigError, ValueError) as err:
        raise _fail(str(err)) from None
    if under_launcher or nproc == 1:
        from ztrain.finetune import run

        raise typer.Exit(run(plan))
    raise typer.Exit(relaunch(_rank_argv(ctx), nproc))


def _rank_argv(ctx: typer.Context) -> list[str]:
    """`finetune` with this command's arguments, for the ranks (not `--nproc`: torchrun's
    argparse would take it as its own `--nproc-per-node`)."""
    argv = ["finetune", str(ctx.params["model_dir"]), str(ctx.params["data"])]
    for p in ctx.command.params:
        value = ctx.params.get(p.name or "")
        if p.name in ("model_dir", "data", "nproc") or value is None or not p.opts:
            continue
        if isinstance(value, bool):  # a flag: given or not
            argv += [p.opts[0]] if value else []
            continue
        argv += [p.opts[0], str(value)]
    return argv


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add `z finetune` (nothing to `z bench`)."""
    app.command("finetune")(finetune)
