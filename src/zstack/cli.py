"""The `z` command line (Typer).

Every command lives in a `zstack.cmd_*` module that imports only typer and the standard
library at load time and exposes `register(app, bench_app)`; this file builds the two apps
and calls each module's `register`, nothing else. Heavy imports happen inside the command
bodies, so `z --help` stays fast and one broken optional dependency cannot break every
command. A new command needs a case in `tests/zstack/test_cli_smoke.py`.
"""

from __future__ import annotations

import typer

from zstack import (
    cmd_bench,
    cmd_bench_cp,
    cmd_chat,
    cmd_doctor,
    cmd_export,
    cmd_finetune,
    cmd_launch,
    cmd_memory,
    cmd_quant,
    cmd_serve,
    cmd_train,
)

app = typer.Typer(
    name="z",
    help="zstack: train and serve giant models on limited hardware.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Run a benchmark from `benchmarks/`; prints one JSON object last.")
app.add_typer(bench_app, name="bench")

# In `z --help` and `z bench --help` order.
for _module in (
    cmd_doctor,
    cmd_launch,
    cmd_bench,
    cmd_bench_cp,
    cmd_memory,
    cmd_train,
    cmd_finetune,
    cmd_export,
    cmd_serve,
    cmd_quant,
    cmd_chat,
):
    _module.register(app, bench_app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
