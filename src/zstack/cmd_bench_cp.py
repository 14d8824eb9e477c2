"""`z bench cp`: sequence parallelism (Ulysses) with ALST's tiling against cp=1."""

from __future__ import annotations

import typer


def bench_cp(
    model: str = typer.Option(
        "small", "--model", help="`small` (random, SmolLM2's heads) or a HF LLaMA directory."
    ),
    layers: int = typer.Option(0, "--layers", min=0, help="Keep the first N layers (0: all)."),
    budget_mib: float = typer.Option(256.0, "--budget-mib", help="Per-rank step memory budget."),
    seq: int = typer.Option(4096, "--seq", min=2, help="The fixed length tokens/s is timed at."),
    start_seq: int = typer.Option(256, "--start-seq", min=1, help="The search's first length."),
    max_seq: int = typer.Option(1 << 16, "--max-seq", min=2, help="The search's last length."),
    steps: int = typer.Option(2, "--steps", min=1, help="Timed steps at --seq."),
    warmup: int = typer.Option(1, "--warmup", min=0),
    probe_repeats: int = typer.Option(
        3, "--probe-repeats", min=1, help="Steps per memory probe; the highest peak counts."
    ),
    resolution: int = typer.Option(
        32, "--resolution", min=1, help="Bisect the longest length to 1/N of itself."
    ),
    floor_seq: int = typer.Option(
        32, "--floor-seq", min=2, help="Length whose step peak is the fixed part (not activations)."
    ),
    loss_tile: int = typer.Option(256, "--loss-tile", min=1, help="Tokens per loss tile."),
    mlp_tile: int = typer.Option(256, "--mlp-tile", min=1, help="Positions per MLP tile."),
    variants: str = typer.Option(
        "cp1,cp1_tiled,cp2,cp2_tiled", "--variants", help="Comma-separated variants."
    ),
    stage: int = typer.Option(3, "--stage", min=0, max=3, help="The ZeRO stage."),
    fixed_heap: bool = typer.Option(
        True, "--fixed-heap/--glibc-heap", help="Fix glibc's mmap threshold in every variant."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """The longest sequence trained within a per-rank memory budget at cp=1 and cp=2, tiling
    on and off, and tokens/s at a fixed length (`max_seq_ratio`: cp2 tiled over cp1)."""
    from zstack.bench import run_benchmark

    options = dict(model=model, layers=layers or None, budget_mib=budget_mib, seq=seq)
    options.update(start_seq=start_seq, max_seq=max_seq, steps=steps, warmup=warmup)
    options.update(probe_repeats=probe_repeats, resolution=resolution, floor_seq=floor_seq)
    options.update(loss_tile=loss_tile, mlp_tile=mlp_tile, variants=variants, stage=stage)
    options.update(fixed_heap=fixed_heap)
    raise typer.Exit(run_benchmark("cp", json_out, **options))


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add `z bench cp` (nothing to `z`)."""
    bench_app.command("cp")(bench_cp)
