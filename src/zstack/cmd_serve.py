"""`z` commands of zserve. Imports only typer at load time; zserve loads when a command runs."""

from __future__ import annotations

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add this module's commands to `z` and `z bench`."""
