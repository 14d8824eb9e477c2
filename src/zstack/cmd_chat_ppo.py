"""`z chat ppo` (PPO with the hybrid engine) and `z bench hybrid` (the hybrid engine's rollout
tokens/s against transformers' ``generate``).

Imports only typer at load time; zchat and torch load when a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from zchat.ppo import PPOConfig


def bench_hybrid(
    model_dir: str | None = typer.Argument(
        None, help="HF model directory (default: SmolLM2-135M-Instruct from `make models`)."
    ),
    num_prompts: int = typer.Option(16, "--num-prompts", min=1, help="Prompts in the rollout."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="Tokens per prompt."),
    token_budget: int = typer.Option(512, "--token-budget", min=1, help="SplitFuse budget."),
    threads: int = typer.Option(1, "--threads", min=1, help="torch threads."),
    zero3_baseline: bool = typer.Option(
        True, "--zero3-baseline/--no-zero3-baseline", help="Also time generate on the ZeRO-3 actor."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """zchat's hybrid engine: rollout tokens/s (gather + SplitFuse generation + release) vs
    transformers `generate` on the same actor weights, with each phase's time and memory."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark(
            "chat_hybrid",
            json_out,
            model_dir=model_dir,
            num_prompts=num_prompts,
            max_tokens=max_tokens,
            token_budget=token_budget,
            threads=threads,
            zero3_baseline=zero3_baseline,
        )
    )


def chat_ppo(
    actor: Path | None = typer.Option(
        None, "--actor", help="The SFT model directory (default: runs/chat/sft)."
    ),
    reward: Path | None = typer.Option(
        None, "--reward", help="The reward model directory (default: runs/chat/reward)."
    ),
    out: Path | None = typer.Option(None, "--out", help="Output (default: runs/chat/ppo)."),
    config: Path | None = typer.Option(None, "--config", help="PPOConfig JSON; flags win."),
    nproc: int | None = typer.Option(None, "--nproc", min=1, help="Ranks (gloo, CPU); default 2."),
    steps: int | None = typer.Option(None, "--steps", help="PPO steps."),
    prompts_per_rank: int | None = typer.Option(None, "--prompts-per-rank"),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens"),
    kl_coef: float | None = typer.Option(None, "--kl-coef", help="KL penalty (>= 0)."),
    actor_lr: float | None = typer.Option(None, "--actor-lr"),
    critic_lr: float | None = typer.Option(None, "--critic-lr"),
    train_prompts: int | None = typer.Option(None, "--train-prompts"),
    heldout_prompts: int | None = typer.Option(None, "--heldout-prompts"),
    seed: int | None = typer.Option(None, "--seed", help="Rollout sampling seed."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """PPO (DeepSpeed-Chat step 3) with the hybrid engine: held-out reward before and after.
    Runs zchat.ppo.config.RECIPE (LoRA only, 20 steps of 16 prompts per rank) unless the
    config or a flag says otherwise."""
    import json

    from zchat.config import load_config
    from zchat.ppo import PPOConfig
    from zchat.ppo.config import RECIPE
    from zchat.ppo.trainer import prepare_ppo

    flags = dict(
        actor=actor,
        reward=reward,
        out=out,
        world=nproc,
        steps=steps,
        prompts_per_rank=prompts_per_rank,
        max_new_tokens=max_new_tokens,
        kl_coef=kl_coef,
        actor_lr=actor_lr,
        critic_lr=critic_lr,
        train_prompts=train_prompts,
        heldout_prompts=heldout_prompts,
        seed=seed,
    )
    data: dict = {
        "actor": "runs/chat/sft",
        "reward": "runs/chat/reward",
        "out": "runs/chat/ppo",
        **RECIPE,
    }
    try:
        if config is not None:
            data.update(json.loads(config.read_text()))
        data.update(
            {k: str(v) if isinstance(v, Path) else v for k, v in flags.items() if v is not None}
        )
        cfg = load_config(PPOConfig, data)
        prepare_ppo(cfg)
    except (OSError, ValueError) as err:  # ChatConfigError names each key; JSON errors too
        typer.echo(f"error: z chat ppo: {err}", err=True)
        raise typer.Exit(2) from None
    run_ppo(cfg, as_json)


def run_ppo(cfg: PPOConfig, as_json: bool) -> dict:
    """Run a checked ``PPOConfig`` on its ranks, draw the PNG, print and return the summary
    (`z chat ppo` and the last stage of `z chat e2e`)."""
    import json
    import time

    from zchat.ppo.trainer import ppo_rank
    from zchat.ranks import RankFailed, run_on_ranks
    from zstack.chat_plot import plot_ppo_metrics

    start = time.perf_counter()
    try:
        results = run_on_ranks(ppo_rank, cfg.world, (cfg,), threads=cfg.threads)
    except RankFailed as err:
        typer.echo(f"error: z chat ppo: {err}", err=True)
        raise typer.Exit(1) from None
    r = results[0]
    metrics = cfg.out / "metrics.jsonl"
    png = plot_ppo_metrics(metrics, metrics.with_suffix(".png"))
    summary = {
        "stage": "ppo",
        "out": r["out"],
        "steps": cfg.steps,
        "ranks": cfg.world,
        "heldout_before": r["before"],
        "heldout_after": r["after"],
        "metrics": str(metrics),
        "plot": str(png),
        "wall_s": time.perf_counter() - start,
    }
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        b, a = r["before"], r["after"]
        typer.echo(
            f"ppo: held-out reward {b['heldout_reward']:+.4f} -> {a['heldout_reward']:+.4f}"
            f", accuracy {b['heldout_accuracy']:.3f} -> {a['heldout_accuracy']:.3f}"
        )
        if "heldout_sampled_reward" in a:
            typer.echo(
                f"ppo: held-out sampled reward {b['heldout_sampled_reward']:+.4f} -> "
                f"{a['heldout_sampled_reward']:+.4f}, accuracy "
                f"{b['heldout_sampled_accuracy']:.3f} -> "
                f"{a['heldout_sampled_accuracy']:.3f}"
            )
        typer.echo(f"wrote `{r['out']}/actor`, `{metrics}`, `{png}`")
    return summary


def register_chat(chat_app: typer.Typer) -> None:
    chat_app.command("ppo")(chat_ppo)


def register_bench(bench_app: typer.Typer) -> None:
    bench_app.command("hybrid")(bench_hybrid)
