"""`z launch`: start a script on N ranks through torchrun (`zstack.launch`).

Imports only typer at load time; `zstack.launch` (and torch) load when the command runs.
"""

from __future__ import annotations

import typer


def launch(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="Training script to run on every rank."),
    nproc: int = typer.Option(1, "--nproc", "--nproc-per-node", min=1, help="Ranks on this node."),
    nnodes: str = typer.Option("1", "--nnodes", help="Nodes, or MIN:MAX for elastic runs."),
    node_rank: int = typer.Option(0, "--node-rank", min=0),
    master_addr: str = typer.Option("127.0.0.1", "--master-addr"),
    master_port: int = typer.Option(29500, "--master-port", min=0, max=65535),
    rdzv_endpoint: str = typer.Option(
        "", "--rdzv-endpoint", help="host:port for multi-node c10d rendezvous."
    ),
) -> None:
    """Start SCRIPT on NPROC ranks through torchrun (`torch.distributed.run`); extra arguments go to the script."""
    from zstack.launch import main

    raise typer.Exit(
        main(
            script=script,
            script_args=list(ctx.args),
            nproc=nproc,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            rdzv_endpoint=rdzv_endpoint,
        )
    )


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add `z launch` to `z` (nothing to `z bench`)."""
    app.command(
        "launch",
        context_settings={
            "allow_extra_args": True,
            "ignore_unknown_options": True,
            # everything after SCRIPT belongs to the script, as with torchrun
            "allow_interspersed_args": False,
        },
    )(launch)
