"""`z chat sft`: supervised fine-tuning of a chat model under ZeRO-3 (zchat.sft).

Imports typer only at load time; zchat, torch and transformers load when it runs.
"""

from __future__ import annotations

from pathlib import Path

import typer

from zstack.chat_stage import DEFAULT_MODEL


def register_chat(chat_app: typer.Typer) -> None:
    @chat_app.command("sft")
    def sft(
        model: Path | None = typer.Option(
            None, "--model", help="Chat model directory (default: SmolLM2-135M-Instruct)."
        ),
        out: Path | None = typer.Option(
            None, "--out", help="Trained model directory (default: runs/chat/sft)."
        ),
        config: Path | None = typer.Option(None, "--config", help="SFTConfig JSON; flags win."),
        nproc: int = typer.Option(2, "--nproc", min=1, help="Ranks on this machine (gloo, CPU)."),
        steps: int | None = typer.Option(None, "--steps", help="Optimizer steps."),
        lr: float | None = typer.Option(None, "--lr", help="Peak learning rate (AdamW)."),
        micro_batch: int | None = typer.Option(None, "--micro-batch", help="Examples per rank."),
        task: str | None = typer.Option(None, "--task", help="`arithmetic` or `shakespeare`."),
        train_examples: int | None = typer.Option(None, "--train-examples", help="Train split."),
        heldout_examples: int | None = typer.Option(None, "--heldout-examples", help="Held out."),
        seed: int | None = typer.Option(None, "--seed", help="Batch order."),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """Fine-tune on the task's answers with the model's chat template (loss on answers only)."""
        from zchat.sft import SFTConfig, prepare_sft, train_sft
        from zstack.chat_stage import run_stage

        defaults = {"model": str(DEFAULT_MODEL), "out": "runs/chat/sft"}
        run_stage(
            "sft",
            defaults,
            SFTConfig,
            prepare_sft,
            train_sft,
            config,
            nproc,
            as_json,
            model=model,
            out=out,
            steps=steps,
            lr=lr,
            micro_batch=micro_batch,
            task=task,
            train_examples=train_examples,
            heldout_examples=heldout_examples,
            seed=seed,
        )
