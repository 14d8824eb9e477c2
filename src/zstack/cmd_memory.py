"""`z estimate-memory`: ZeRO model-state memory per device, host and NVMe (`zcore.memory`).

Imports only typer and the standard library at load time, so registering the command in
`zstack.cli` keeps `z --help` fast; `zcore.memory` (pure Python) loads when it runs.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from zcore.memory import MemoryEstimate


class Offload(str, Enum):
    """Where offloaded state goes."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


# (stage, offload_optimizer, offload_param) rows of the all-stages table, as DeepSpeed's
# estimator lists them: each stage with the offload options that apply to it.
TABLE_ROWS: tuple[tuple[int, str, str], ...] = (
    (0, "none", "none"),
    (1, "none", "none"),
    (1, "cpu", "none"),
    (1, "nvme", "none"),
    (2, "none", "none"),
    (2, "cpu", "none"),
    (2, "nvme", "none"),
    (3, "none", "none"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
    (3, "nvme", "none"),
    (3, "nvme", "cpu"),
    (3, "nvme", "nvme"),
)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _table(estimates: list[MemoryEstimate]) -> str:
    from zcore.memory import format_bytes

    def size(field: str) -> list[str]:
        return [format_bytes(getattr(e, field)) for e in estimates]

    # (header, left-aligned, cells)
    columns = [
        ("stage", False, [str(e.stage) for e in estimates]),
        ("offload optimizer", True, [e.offload_optimizer for e in estimates]),
        ("offload param", True, [e.offload_param for e in estimates]),
        ("per device", False, size("total")),
        ("params", False, size("params")),
        ("grads", False, size("grads")),
        ("optimizer", False, size("optimizer")),
        ("gathered", False, size("gathered")),
        ("host per node", False, size("host_per_node")),
        ("nvme per node", False, size("nvme_per_node")),
    ]
    if not any(e.gathered for e in estimates):
        columns = [c for c in columns if c[0] != "gathered"]
    lines = []
    for i in range(len(estimates) + 1):
        cells = []
        for header, left, values in columns:
            width = max(len(header), *(len(v) for v in values))
            cell = header if i == 0 else values[i - 1]
            cells.append(cell.ljust(width) if left else cell.rjust(width))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def estimate_memory(
    params: str = typer.Option(
        ..., "--params", help='Model parameters, e.g. "125M", "1.3B", "7e9".'
    ),
    world_size: int = typer.Option(
        ..., "--world-size", min=1, help="Data-parallel ranks the state is sharded over."
    ),
    gpus_per_node: int | None = typer.Option(
        None,
        "--gpus-per-node",
        min=1,
        show_default="world size",
        help="Ranks per node, for the per-node host and NVMe totals.",
    ),
    stage: int | None = typer.Option(
        None, "--stage", min=0, max=3, help="ZeRO stage; without it, a table of all stages."
    ),
    offload_optimizer: Offload | None = typer.Option(
        None, "--offload-optimizer", help="Optimizer state to host RAM or NVMe (stage 1-3)."
    ),
    offload_param: Offload | None = typer.Option(
        None, "--offload-param", help="Parameters to host RAM or NVMe (stage 3)."
    ),
    largest_layer: str = typer.Option(
        "0", "--largest-layer", help="Parameters of the largest layer (stage 3 working set)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Estimate ZeRO model-state memory (params, grads, optimizer) per device, host and NVMe."""
    from zcore.memory import model_state_bytes, parse_count

    try:
        n_params = parse_count(params)
    except ValueError as e:
        raise _fail(f"invalid `--params`: {e}") from None
    try:
        n_largest = parse_count(largest_layer)
    except ValueError as e:
        raise _fail(f"invalid `--largest-layer`: {e}") from None
    opt = offload_optimizer.value if offload_optimizer is not None else None
    par = offload_param.value if offload_param is not None else None

    if stage is not None:
        combos = [(stage, opt or "none", par or "none")]
    else:
        # Without --stage, an offload option filters the table to the rows that use it.
        combos = [
            row
            for row in TABLE_ROWS
            if (opt is None or row[1] == opt) and (par is None or row[2] == par)
        ]
        if not combos:
            raise _fail(
                f"no stage supports `--offload-optimizer {opt}` with `--offload-param {par}`; "
                "pass `--stage 3` to estimate it anyway"
            )
    estimates = []
    for s, o, p in combos:
        try:
            estimates.append(
                model_state_bytes(
                    n_params,
                    world_size,
                    s,
                    offload_optimizer=o,
                    offload_param=p,
                    gpus_per_node=gpus_per_node,
                    largest_layer_params=n_largest if s == 3 or stage is not None else 0,
                )
            )
        except ValueError as e:
            raise _fail(str(e)) from None

    if json_out:
        if stage is not None:
            typer.echo(json.dumps(estimates[0].to_dict()))
        else:
            typer.echo(
                json.dumps(
                    {
                        "num_params": n_params,
                        "world_size": world_size,
                        "gpus_per_node": estimates[0].gpus_per_node,
                        "estimates": [e.to_dict() for e in estimates],
                    }
                )
            )
        return
    e0 = estimates[0]
    nodes = world_size // e0.gpus_per_node
    typer.echo(
        f"model states for {n_params:,} params on {world_size} ranks "
        f"({nodes} node{'s' if nodes > 1 else ''} x {e0.gpus_per_node}); "
        "activations and buffers not included"
    )
    typer.echo(_table(estimates))
    if any(e.host_per_node for e in estimates):
        typer.echo("host per node includes a 1.5x buffer factor, as DeepSpeed's estimator does")
    if any(e.stage == 3 for e in estimates) and not n_largest:
        typer.echo("stage 3 also gathers the largest layer; pass `--largest-layer` to count it")


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add `z estimate-memory` to `z` (nothing to `z bench`)."""
    app.command("estimate-memory")(estimate_memory)
