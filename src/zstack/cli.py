"""The `z` command line (Typer). Each command lives in its own module and is
imported when run, so `z --help` stays fast and one broken optional
dependency cannot break every command."""

from __future__ import annotations

from enum import Enum

import typer

app = typer.Typer(
    name="z",
    help="zstack: train and serve giant models on limited hardware.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Run a benchmark from `benchmarks/`; prints one JSON object last.")
app.add_typer(bench_app, name="bench")


@app.command()
def doctor(
    json_out: bool = typer.Option(
        False, "--json", help="Print one JSON object instead of a report."
    ),
) -> None:
    """Report versions, CPU/GPU capabilities and what is missing, with the fix for each."""
    from zstack.doctor import main

    raise typer.Exit(main(json_out=json_out))


@app.command(
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": True,
        # everything after SCRIPT belongs to the script, as with torchrun
        "allow_interspersed_args": False,
    },
)
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


class AdamDtype(str, Enum):
    """Optimizer-state precision of `z bench adam`."""

    fp32 = "fp32"
    bf16_states = "bf16-states"


@bench_app.command("adam")
def bench_adam(
    numel: int = typer.Option(
        100_000_000, "--numel", min=1, help="Parameters in the tensor stepped."
    ),
    dtype: AdamDtype = typer.Option(AdamDtype.fp32, "--dtype", help="State precision."),
    steps: int = typer.Option(
        10, "--steps", min=1, help="Timed steps per optimizer (median reported)."
    ),
    warmup: int = typer.Option(2, "--warmup", min=0),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """Time CPUAdam against torch's fused/foreach Adam (and DeepSpeedCPUAdam if importable)."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark("adam", json_out, numel=numel, dtype=dtype.value, steps=steps, warmup=warmup)
    )


@bench_app.command("zero")
def bench_zero(
    world_size: int = typer.Option(4, "--world-size", min=1, help="gloo ranks to spawn."),
    preset: str = typer.Option("small", "--preset", help="`z train` GPT size."),
    stages: str = typer.Option("0,1,2,3", "--stages", help="Comma-separated ZeRO stages."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """Measured ZeRO model-state bytes per rank (stages 0-3) next to the 16Ψ/N-style formula."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark("zero", json_out, world_size=world_size, preset=preset, stages=stages)
    )


@bench_app.command("zero-step")
def bench_zero_step(
    preset: str = typer.Option("medium", "--preset", help="`z train` GPT size."),
    stages: str = typer.Option("1,2,3", "--stages", help="Comma-separated ZeRO stages."),
    steps: int = typer.Option(5, "--steps", min=1, help="Timed steps per run (median reported)."),
    warmup: int = typer.Option(2, "--warmup", min=0),
    rounds: int = typer.Option(1, "--rounds", min=1, help="Alternating ours/DeepSpeed runs."),
    micro_batch: int = typer.Option(4, "--micro-batch", min=1),
    seq: int = typer.Option(256, "--seq", min=1, help="Tokens per sequence."),
    world_size: int = typer.Option(2, "--world-size", min=1, help="gloo ranks to spawn."),
    no_ds: bool = typer.Option(False, "--no-ds", help="Time zcore only."),
    profile: bool = typer.Option(False, "--profile", help="cProfile rank 0's timed steps."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """ZeRO step time and peak RSS of zcore next to `deepspeed.initialize` (if importable)."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark(
            "zero_step",
            json_out,
            preset=preset,
            stages=stages,
            steps=steps,
            warmup=warmup,
            rounds=rounds,
            micro_batch=micro_batch,
            seq=seq,
            world_size=world_size,
            deepspeed=not no_ds,
            profile=profile,
        )
    )


@bench_app.command("offload")
def bench_offload(
    dir: str | None = typer.Option(
        None, "--dir", help="Swap directory on the NVMe drive (default: the temp dir)."
    ),
    preset: str = typer.Option("medium", "--preset", help="`z train` GPT size."),
    stage: int = typer.Option(2, "--stage", min=1, max=3, help="ZeRO stage."),
    steps: int = typer.Option(5, "--steps", min=1, help="Timed steps per mode (median)."),
    warmup: int = typer.Option(2, "--warmup", min=0),
    micro_batch: int = typer.Option(2, "--micro-batch", min=1),
    sub_group_size: int = typer.Option(4_194_304, "--sub-group-size", min=1024),
    block_size: int = typer.Option(1_048_576, "--block-size", min=4096),
    queue_depth: int = typer.Option(32, "--queue-depth", min=1),
    modes: str = typer.Option("none,cpu,nvme,nvme_serial", "--modes", help="Also: nvme_all."),
    beyond_ram: bool = typer.Option(
        False, "--beyond-ram", help="Stage 3, params+optimizer on NVMe vs none, lean memory."
    ),
    n_layer: int | None = typer.Option(None, "--n-layer", min=1, help="Override the preset."),
    n_embd: int | None = typer.Option(None, "--n-embd", min=8, help="Override the preset."),
    seq: int = typer.Option(256, "--seq", min=1, help="Tokens per sequence."),
    world_size: int = typer.Option(2, "--world-size", min=1, help="gloo ranks to spawn."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """Step time and peak RSS per rank with no offload, CPU offload and NVMe offload."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark(
            "offload",
            json_out,
            world_size=world_size,
            preset=preset,
            stage=stage,
            dir=dir,
            steps=steps,
            warmup=warmup,
            micro_batch=micro_batch,
            sub_group_size=sub_group_size,
            block_size=block_size,
            queue_depth=queue_depth,
            modes=modes,
            beyond_ram=beyond_ram,
            n_layer=n_layer,
            n_embd=n_embd,
            seq=seq,
        )
    )


@bench_app.command("io")
def bench_io(
    size: str = typer.Option("1GiB", "--size", help="Bytes per file, e.g. 1GiB, 64MiB."),
    dir: str | None = typer.Option(
        None, "--dir", help="Directory on the drive to test (default: tmp)."
    ),
    block_size: str = typer.Option("1MiB", "--block-size", help="Bytes per IO request."),
    queue_depth: int = typer.Option(128, "--queue-depth", min=1, help="IOs in flight per ring."),
    intra_op: int = typer.Option(1, "--intra-op-parallelism", min=1, help="IO worker threads."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Interleaved rounds (median reported)."),
    no_ds: bool = typer.Option(False, "--no-ds", help="Skip DeepSpeed's aio_handle."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """Write/read GB/s of the async IO engine next to Python, torch.save and DeepSpeed aio."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark(
            "io",
            json_out,
            size=size,
            dir=dir,
            block_size=block_size,
            queue_depth=queue_depth,
            intra_op_parallelism=intra_op,
            rounds=rounds,
            deepspeed=not no_ds,
        )
    )


# cmd_memory imports only typer at load time (zcore.memory loads when the command runs).
from zstack.cmd_memory import estimate_memory  # noqa: E402

app.command("estimate-memory")(estimate_memory)

# cmd_train imports only typer and the standard library at load time (torch loads when run).
from zstack.cmd_train import checkpoint_app, generate, train  # noqa: E402

app.command("train")(train)
app.command("generate")(generate)
app.add_typer(checkpoint_app, name="checkpoint")

# zserve (`z serve`, `z bench serve`) and zquant (`z quantize`, `z eval`, `z bench quant`).
from zstack import cmd_quant, cmd_serve  # noqa: E402

cmd_serve.register(app, bench_app)
cmd_quant.register(app, bench_app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
