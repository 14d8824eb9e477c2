"""`z doctor`: versions, CPU/GPU capabilities and what is missing (`zstack.doctor`).

Imports only typer at load time; `zstack.doctor` loads when the command runs.
"""

from __future__ import annotations

import typer


def doctor(
    json_out: bool = typer.Option(
        False, "--json", help="Print one JSON object instead of a report."
    ),
) -> None:
    """Report versions, CPU/GPU capabilities and what is missing, with the fix for each."""
    from zstack.doctor import main

    raise typer.Exit(main(json_out=json_out))


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add `z doctor` to `z` (nothing to `z bench`)."""
    app.command("doctor")(doctor)
