"""`z chat`: zchat's RLHF stages (`z chat sft | reward | ppo | dpo | grpo | e2e`).

Imports only typer at load time. Each stage's command lives in its own `zstack.cmd_chat_*`
module exposing `register_chat(chat_app)` (and `register_bench(bench_app)` for a stage's
`z bench` entry); this file builds the `chat` group and calls them
in `z chat --help` order. zchat and torch load when a command runs.
"""

from __future__ import annotations

import importlib

import typer

# Stage command modules, in `z chat --help` order. Add a stage by adding its module here.
STAGE_MODULES: tuple[str, ...] = (
    "cmd_chat_sft",
    "cmd_chat_reward",
    "cmd_chat_ppo",
    "cmd_chat_dpo",
    "cmd_chat_grpo",
    "cmd_chat_e2e",
)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    chat_app = typer.Typer(
        help="RLHF a la DeepSpeed-Chat on ZeRO-3: SFT, reward model, PPO (hybrid engine), DPO, GRPO.",
        no_args_is_help=True,
    )
    for name in STAGE_MODULES:
        module = importlib.import_module(f"zstack.{name}")
        module.register_chat(chat_app)
        if hasattr(module, "register_bench"):  # a stage's benchmark: `z bench <name>`
            module.register_bench(bench_app)
    app.add_typer(chat_app, name="chat")
