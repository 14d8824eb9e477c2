"""`z chat e2e`: SFT -> reward model -> PPO in one command (zchat.e2e), each stage's output
directory the next one's input, each stage printing its progress lines and writing its
metrics JSONL and PNG as `z chat sft | reward | ppo` do.

Imports only typer at load time; zchat and torch load when it runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from zstack.chat_stage import DEFAULT_MODEL


def chat_e2e(
    config: Path | None = typer.Option(
        None,
        "--config",
        help="E2EConfig JSON (model, out, world, task, and sft/reward/ppo blocks).",
    ),
    model: Path | None = typer.Option(None, "--model", help="Base chat model (default: SmolLM2)."),
    out: Path | None = typer.Option(None, "--out", help="Output root (default: runs/chat/e2e)."),
    nproc: int | None = typer.Option(None, "--nproc", min=1, help="Ranks (gloo, CPU); default 2."),
    as_json: bool = typer.Option(False, "--json", help="Print the final summary as JSON."),
) -> None:
    """DeepSpeed-Chat's three steps end to end: SFT, reward model, PPO (LoRA, hybrid engine)."""
    from zchat.config import ChatConfigError, load_config
    from zchat.e2e import E2EConfig
    from zchat.ppo import PPOConfig
    from zchat.ppo.trainer import prepare_ppo
    from zchat.reward_train import RewardConfig, prepare_reward, train_reward
    from zchat.sft import SFTConfig, prepare_sft, train_sft
    from zstack.chat_stage import run_stage
    from zstack.cmd_chat_ppo import run_ppo

    try:
        data: dict = {"model": str(DEFAULT_MODEL)}
        if config is not None:
            try:
                data.update(json.loads(config.read_text()))
            except (OSError, ValueError) as err:
                raise ChatConfigError(f"cannot read `{config}`: {err}") from None
        flags = {"model": model, "out": out, "world": nproc}
        cfg = load_config(E2EConfig, data, **{k: v for k, v in flags.items() if v is not None})
        cfg.check_stages()
    except ChatConfigError as err:
        typer.echo(f"error: z chat e2e: {err}", err=True)
        raise typer.Exit(2) from None
    start = time.perf_counter()
    stages: dict[str, dict] = {}
    for name, cls, prepare, train in (
        ("sft", SFTConfig, prepare_sft, train_sft),
        ("reward", RewardConfig, prepare_reward, train_reward),
    ):
        typer.echo(f"== z chat e2e: {name} ==")
        stages[name] = run_stage(
            name, cfg.stage_dict(name), cls, prepare, train, None, cfg.world, False
        )
    typer.echo("== z chat e2e: ppo ==")
    try:
        ppo_cfg = load_config(PPOConfig, cfg.stage_dict("ppo"))
        prepare_ppo(ppo_cfg)
    except ValueError as err:
        typer.echo(f"error: z chat e2e: ppo: {err}", err=True)
        raise typer.Exit(2) from None
    stages["ppo"] = run_ppo(ppo_cfg, False)
    summary = {
        "stage": "e2e",
        "out": str(cfg.out),
        "wall_s": time.perf_counter() - start,
        "stage_wall_s": {k: v["wall_s"] for k, v in stages.items()},
        "sft_heldout": stages["sft"]["heldout_after"],
        "reward_heldout": stages["reward"]["heldout_after"],
        "ppo_heldout_before": stages["ppo"]["heldout_before"],
        "ppo_heldout_after": stages["ppo"]["heldout_after"],
    }
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        walls = ", ".join(f"{k} {v:.0f} s" for k, v in summary["stage_wall_s"].items())
        typer.echo(f"e2e: {summary['wall_s']:.0f} s ({walls}); wrote `{cfg.out}`")


def register_chat(chat_app: typer.Typer) -> None:
    chat_app.command("e2e")(chat_e2e)
