"""`z chat dpo`: Direct Preference Optimization against the frozen SFT model, under ZeRO-3.

Imports typer only at load time; zchat, torch and transformers load when it runs.
"""

from __future__ import annotations

from pathlib import Path

import typer


def register_chat(chat_app: typer.Typer) -> None:
    @chat_app.command("dpo")
    def dpo(
        model: Path | None = typer.Option(
            None, "--model", help="The SFT model directory (default: runs/chat/sft)."
        ),
        out: Path | None = typer.Option(
            None, "--out", help="Trained model directory (default: runs/chat/dpo)."
        ),
        config: Path | None = typer.Option(None, "--config", help="DPOConfig JSON; flags win."),
        nproc: int = typer.Option(2, "--nproc", min=1, help="Ranks on this machine (gloo, CPU)."),
        steps: int | None = typer.Option(None, "--steps", help="Optimizer steps."),
        lr: float | None = typer.Option(None, "--lr", help="Peak learning rate (AdamW)."),
        micro_batch: int | None = typer.Option(None, "--micro-batch", help="Pairs per rank."),
        task: str | None = typer.Option(None, "--task", help="`arithmetic` or `shakespeare`."),
        train_examples: int | None = typer.Option(None, "--train-examples", help="Train split."),
        heldout_examples: int | None = typer.Option(None, "--heldout-examples", help="Held out."),
        seed: int | None = typer.Option(None, "--seed", help="Batch order."),
        beta: float | None = typer.Option(None, "--beta", help="DPO beta (default 0.1)."),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    ) -> None:
        """DPO on the task's preference pairs; report held-out metrics before and after."""
        from zchat.dpo import DPOConfig, prepare_dpo, train_dpo
        from zstack.chat_stage import run_stage

        defaults = {"model": "runs/chat/sft", "out": "runs/chat/dpo"}
        run_stage(
            "dpo",
            defaults,
            DPOConfig,
            prepare_dpo,
            train_dpo,
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
            beta=beta,
        )
