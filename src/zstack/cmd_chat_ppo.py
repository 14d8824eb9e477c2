"""`z chat ppo` (PPO with the hybrid engine) and `z bench hybrid` (the hybrid engine's rollout
tokens/s against transformers' ``generate``).

Imports only typer at load time; zchat and torch load when a command runs.
"""

from __future__ import annotations

import typer


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


def register_chat(chat_app: typer.Typer) -> None:
    """`z chat ppo` (added with zchat.ppo)."""


def register_bench(bench_app: typer.Typer) -> None:
    bench_app.command("hybrid")(bench_hybrid)
