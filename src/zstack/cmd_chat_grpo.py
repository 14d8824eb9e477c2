"""`z chat grpo`: GRPO with a program-verifiable reward (arithmetic) on the hybrid engine.

Imports only typer at load time; zchat and torch load when it runs.
"""

from __future__ import annotations

from pathlib import Path

import typer


def chat_grpo(
    actor: Path | None = typer.Option(
        None, "--actor", help="The model to train (default: runs/chat/sft)."
    ),
    out: Path | None = typer.Option(None, "--out", help="Output (default: runs/chat/grpo)."),
    nproc: int | None = typer.Option(None, "--nproc", min=1, help="Ranks (gloo, CPU); default 2."),
    steps: int | None = typer.Option(None, "--steps", help="GRPO steps."),
    prompts_per_rank: int | None = typer.Option(None, "--prompts-per-rank"),
    group_size: int | None = typer.Option(None, "--group-size", help="Samples per prompt."),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens"),
    micro_batch: int | None = typer.Option(
        None, "--micro-batch", help="Rollout rows per forward/backward (0: all at once)."
    ),
    kl_coef: float | None = typer.Option(None, "--kl-coef", help="KL penalty (>= 0)."),
    lr: float | None = typer.Option(None, "--lr"),
    train_prompts: int | None = typer.Option(None, "--train-prompts"),
    heldout_prompts: int | None = typer.Option(None, "--heldout-prompts"),
    seed: int | None = typer.Option(None, "--seed", help="Rollout sampling seed."),
    heldout_samples: int | None = typer.Option(
        None, "--heldout-samples", help="Fixed-seed sampled answers per held-out prompt."
    ),
    config: Path | None = typer.Option(None, "--config", help="GRPOConfig JSON; flags win."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """GRPO: group-relative advantages from a program's grade; held-out accuracy before/after."""
    import json
    import time

    from zchat.config import load_config
    from zchat.grpo import RECIPE, GRPOConfig, grpo_rank, prepare_grpo
    from zchat.ranks import RankFailed, run_on_ranks

    flags = dict(
        actor=actor,
        out=out,
        world=nproc,
        steps=steps,
        prompts_per_rank=prompts_per_rank,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        micro_batch=micro_batch,
        kl_coef=kl_coef,
        lr=lr,
        train_prompts=train_prompts,
        heldout_prompts=heldout_prompts,
        seed=seed,
        heldout_samples=heldout_samples,
    )
    data: dict = {"actor": "runs/chat/sft", "out": "runs/chat/grpo", **RECIPE}
    try:
        if config is not None:
            data.update(json.loads(config.read_text()))
        data.update({k: v for k, v in flags.items() if v is not None})
        cfg = load_config(GRPOConfig, data)
        prepare_grpo(cfg)  # no chat template, a LoRA name matching nothing: named here
    except (OSError, ValueError) as err:  # ChatConfigError names each key; JSON errors too
        typer.echo(f"error: z chat grpo: {err}", err=True)
        raise typer.Exit(2) from None
    start = time.perf_counter()
    try:
        r = run_on_ranks(grpo_rank, cfg.world, (cfg,), threads=cfg.threads)[0]
    except RankFailed as err:
        typer.echo(f"error: z chat grpo: {err}", err=True)
        raise typer.Exit(1) from None
    summary = {
        "stage": "grpo",
        "ranks": cfg.world,
        "steps": cfg.steps,
        **r,
        "metrics": str(cfg.out / "metrics.jsonl"),
        "wall_s": time.perf_counter() - start,
    }
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        sampled = ""
        if "heldout_sampled_accuracy_before" in r:
            sampled = (
                f", sampled {r['heldout_sampled_accuracy_before']:.3f} -> "
                f"{r['heldout_sampled_accuracy_after']:.3f}"
            )
        typer.echo(
            f"grpo: held-out accuracy {r['heldout_accuracy_before']:.3f} -> "
            f"{r['heldout_accuracy_after']:.3f}{sampled}; wrote `{r['out']}/actor`"
        )


def register_chat(chat_app: typer.Typer) -> None:
    chat_app.command("grpo")(chat_grpo)
