"""`z export-mixtral`: a `z train --moe` run as a Hugging Face Mixtral checkpoint directory.

Imports only typer and the standard library at load time; the work is
`ztrain.mixtral_export.export_run`.
"""

from __future__ import annotations

from pathlib import Path

import typer


def export_mixtral(
    run_dir: Path = typer.Argument(
        ..., help="The `--out` of `z train --moe` (or its `checkpoints/`)."
    ),
    out_dir: Path = typer.Argument(..., help="The Mixtral directory to write (replaced if there)."),
    tag: str | None = typer.Option(
        None, "--tag", help="Checkpoint tag (default: the `latest` one)."
    ),
) -> None:
    """Write a `z train --moe` model as a Mixtral checkpoint (transformers and `z serve` load it)."""
    from zcore.checkpoint import CheckpointError
    from ztrain.mixtral_export import ExportError, export_run

    try:
        out, config = export_run(run_dir, out_dir, tag)
    except (OSError, ExportError, CheckpointError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    note = (
        ""
        if config.dropless
        else (
            f" (trained with capacity factor {config.capacity_factor:g}; Mixtral routes dropless)"
        )
    )
    typer.echo(
        f"wrote `{out}`: Mixtral, {config.n_layer} layers x {config.experts[0]} experts, "
        f"top-{config.k}, {config.num_params() / 1e6:.1f}M params{note}\n"
        f"next: `z serve {out}`"
    )


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add `z export-mixtral` (nothing to `z bench`)."""
    app.command("export-mixtral")(export_mixtral)
