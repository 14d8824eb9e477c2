"""`z train`, `z generate` and `z checkpoint consolidate`.

Imports only typer and the standard library at load time (`zstack.cli` registers these
commands); torch and the recipes load when a command runs. `z train --nproc N` plans the
run (`ztrain.train_plan.plan_run`: a bad run fails here, before any rank starts),
then starts itself again on N ranks through `z launch`'s torchrun; each rank plans the
same run and runs `ztrain.train.run` on it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from zstack.relaunch import relaunch, z_script
from ztrain.train_options import DEFAULT_STEPS, TrainError, TrainOptions

checkpoint_app = typer.Typer(
    help="Work with the sharded checkpoints `z train` writes.", no_args_is_help=True
)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _explicit(ctx: typer.Context) -> frozenset[str]:
    """The options given on the command line."""
    return frozenset(
        p.name
        for p in ctx.command.params
        # by name: typer may carry its own copy of click's ParameterSource enum
        if p.name and getattr(ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE"
    )


def _rank_argv(ctx: typer.Context, explicit: frozenset[str]) -> list[str]:
    """`train` plus the options given here, for the ranks (so they see the same explicit set).

    Not `--nproc`: torchrun's argparse reads the script's arguments too and rejects it as an
    ambiguous abbreviation of its own `--nproc-per-node`/`--nproc_per_node`.
    """
    argv = ["train"]
    for p in ctx.command.params:
        if p.name in explicit and p.name != "nproc" and getattr(p, "opts", None):
            value = ctx.params[p.name]
            if getattr(p, "is_flag", False):
                argv += [p.opts[0]] if value else []
            else:
                argv += [p.opts[0], str(value)]
    return argv


def train(
    ctx: typer.Context,
    out: Path = typer.Option(Path("runs/shakespeare"), "--out", help="Run directory."),
    nproc: int = typer.Option(2, "--nproc", min=1, help="Ranks on this machine (gloo, CPU)."),
    preset: str = typer.Option(
        "small", "--preset", help="GPT size: tiny, small, medium or deep (12 thin layers)."
    ),
    steps: int = typer.Option(
        DEFAULT_STEPS, "--steps", min=1, help="Optimizer steps of the whole run."
    ),
    stage: int = typer.Option(3, "--stage", min=0, max=3, help="ZeRO stage."),
    config: Path | None = typer.Option(
        None, "--config", help="DeepSpeed JSON config; its keys win over the flags."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the latest checkpoint in `OUT/checkpoints`."
    ),
    micro_batch: int = typer.Option(8, "--micro-batch", min=1, help="Sequences per rank."),
    grad_accum: int = typer.Option(1, "--grad-accum", min=1, help="Micro-batches per step."),
    seq_len: int | None = typer.Option(
        None,
        "--seq-len",
        min=1,
        help="Tokens per sequence (default: the preset's block_size, at most 256).",
    ),
    lr: float = typer.Option(1e-3, "--lr", min=0.0, help="Peak learning rate (AdamW)."),
    eval_every: int | None = typer.Option(
        None,
        "--eval-every",
        min=1,
        help="Steps between val passes (default: a tenth of the steps).",
    ),
    seed: int = typer.Option(0, "--seed", min=0, help="Model init and batch order."),
    vocab_size: int = typer.Option(2048, "--vocab-size", min=257, help="BPE vocabulary."),
    bf16: bool = typer.Option(False, "--bf16", help="bfloat16 mixed precision."),
    save_every: int = typer.Option(
        0, "--save-every", min=0, help="Steps between checkpoints; 0: at the end only."
    ),
    moe: bool = typer.Option(
        False, "--moe", help="Train a Mixtral-style MoE LM (SwiGLU experts, top-k) instead."
    ),
    moe_experts: str = typer.Option(
        "8", "--moe-experts", help="Experts per MoE layer; `4,8`: a pyramid over layer groups."
    ),
    moe_top_k: int = typer.Option(2, "--moe-top-k", help="Experts per token."),
    moe_layers: str = typer.Option(
        "every", "--moe-layers", help="Which layers are MoE: `every` or `every-other`."
    ),
    moe_capacity_factor: float = typer.Option(
        1.0, "--moe-capacity-factor", help="Expert capacity, x the balanced share."
    ),
    moe_dropless: bool = typer.Option(
        False, "--moe-dropless", help="No capacity limit: no token is dropped."
    ),
    moe_ep: int = typer.Option(1, "--moe-ep", help="Expert-parallel ranks (ep_size)."),
    moe_aux_coef: float = typer.Option(
        0.01, "--moe-aux-coef", help="Load-balancing loss weight in the training loss."
    ),
    dense_twin: bool = typer.Option(
        False, "--dense-twin", help="The MoE model's dense twin: same active parameters."
    ),
    pp: int = typer.Option(
        1, "--pp", min=1, help="Pipeline stages; NPROC = pp x tp x data-parallel ranks."
    ),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel ranks each layer is cut over."),
    schedule: str = typer.Option(
        "1f1b", "--schedule", help="Pipeline schedule: 1f1b, gpipe or interleaved_1f1b."
    ),
    microbatches: int | None = typer.Option(
        None, "--microbatches", min=1, help="Micro-batches per step under --pp (default 2 x pp)."
    ),
    cp: int = typer.Option(
        1, "--cp", min=1, help="Ranks sharing each sequence (sequence parallelism, --cp-mode)."
    ),
    cp_mode: str = typer.Option(
        "ulysses", "--cp-mode", help="Attention across the --cp ranks: ulysses or ring."
    ),
    model: Path | None = typer.Option(
        None,
        "--model",
        help="A Hugging Face causal LM (LLaMA/Mistral/Qwen2 at --tp) trained on the plays "
        "through `z finetune`.",
    ),
) -> None:
    """Train a GPT (or with `--moe` a Mixtral-style MoE) on Shakespeare with ZeRO on NPROC ranks."""
    from zcore.config import ConfigError

    explicit = _explicit(ctx)
    if model is not None:  # a Hugging Face model: zcore.hf.Trainer, as `z finetune` runs it
        from zstack import train_hf

        bad = train_hf.refused(explicit)
        if bad:
            raise _fail(
                f"{', '.join(bad)} shape `z train`'s own GPT; with `--model` the model is "
                f"`{model}`'s config: drop {'them' if len(bad) > 1 else 'it'}"
            )
        if config is not None and explicit & {"stage", "bf16"}:
            raise _fail(
                "`--config` with `--stage`/`--bf16`: set zero_optimization.stage and bf16 in "
                "the config, or drop `--config`"
            )
        raise typer.Exit(train_hf.run(z_script(), model, ctx.params, explicit))
    opts = TrainOptions(
        out=out,
        preset=preset,
        steps=steps,
        stage=stage,
        config=config,
        resume=resume,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        seq_len=seq_len,
        lr=lr,
        eval_every=eval_every,
        seed=seed,
        vocab_size=vocab_size,
        bf16=bf16,
        save_every=save_every,
        moe=moe,
        moe_experts=moe_experts,
        moe_top_k=moe_top_k,
        moe_layers=moe_layers,
        moe_capacity_factor=moe_capacity_factor,
        moe_dropless=moe_dropless,
        moe_ep=moe_ep,
        moe_aux_coef=moe_aux_coef,
        dense_twin=dense_twin,
        pp=pp,
        tp=tp,
        schedule=schedule,
        microbatches=microbatches,
        cp=cp,
        cp_mode=cp_mode,
        explicit=explicit,
    )
    under_launcher = "RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if under_launcher else nproc
    try:
        from ztrain.run_lock import hold_run_dir
        from ztrain.train import run
        from ztrain.train_plan import plan_run

        plan = plan_run(opts, world_size)
        if under_launcher:  # a rank: the launcher has said the notes and holds `--out`
            raise typer.Exit(run(plan))
        for note in plan.notes:
            typer.echo(f"note: {note}", err=True)
        for warning in plan.warnings:
            typer.echo(f"warning: {warning}", err=True)
        with hold_run_dir(opts.out):
            raise typer.Exit(
                run(plan) if nproc == 1 else relaunch(_rank_argv(ctx, explicit), nproc)
            )
    except (ConfigError, TrainError) as err:
        raise _fail(str(err)) from None


def _load_model(path: Path) -> tuple[Any, Any]:
    """(GPT or MoELM, Tokenizer) from a run directory, an export directory or file, or a checkpoint."""
    import json

    from zcore.checkpoint import consolidate
    from ztrain.generate import MODEL_JSON, TOKENIZER_JSON, WEIGHTS, load_for_generation
    from ztrain.gpt_pipe import as_gpt_state
    from ztrain.moe_plan import build_model, config_from_dict, drop_non_persistent
    from ztrain.tokenizer import Tokenizer

    if path.is_file() or (path / WEIGHTS).is_file():
        return load_for_generation(path)
    if (path / "export" / WEIGHTS).is_file():
        return load_for_generation(path / "export")
    if (path / "manifest.json").is_file():  # one tag of a checkpoint
        root, tag = path.parent, path.name
    elif (path / "latest").is_file():
        root, tag = path, None
    else:
        raise FileNotFoundError(
            f"`{path}` is not a `z train` run, export or checkpoint directory; "
            "pass the `--out` of `z train` (default `runs/shakespeare`)"
        )
    missing = [n for n in (MODEL_JSON, TOKENIZER_JSON) if not (root / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"checkpoint `{root}` has no {' or '.join(missing)} beside it; "
            "pass the run directory or its `export/` instead"
        )
    model = build_model(config_from_dict(json.loads((root / MODEL_JSON).read_text()), ep_size=1))
    state = as_gpt_state(consolidate(str(root), tag), model.config)  # a `--pp` run's names
    model.load_state_dict(drop_non_persistent(state, model))
    return model.eval(), Tokenizer.load(root / TOKENIZER_JSON)


def generate(
    checkpoint: Path = typer.Option(
        ..., "--checkpoint", help="Run directory, its `export/`, or a sharded checkpoint."
    ),
    prompt: str = typer.Option(..., "--prompt", help="Text to continue."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", min=0),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="0 is greedy."),
    top_k: int = typer.Option(50, "--top-k", min=0, help="Sample from the K likeliest; 0: all."),
    seed: int | None = typer.Option(None, "--seed", help="Reproducible sampling."),
) -> None:
    """Continue PROMPT with a GPT trained by `z train`; prints the text."""
    import torch

    from ztrain.generate import generate as sample

    # One token at a time through a small model: OpenMP threads cost more than they give
    # (120 tokens of `small` took 46 s on 2 threads vs 1.7 s on 1, on a busy 2-core box).
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    try:
        model, tokenizer = _load_model(checkpoint)
    except (OSError, ValueError) as err:
        raise _fail(str(err)) from None
    text = sample(model, tokenizer, prompt, max_new_tokens, temperature, top_k or None, seed)
    typer.echo(text)


def consolidate(
    ckpt_dir: Path = typer.Argument(..., help="The checkpoint directory (`OUT/checkpoints`)."),
    out: Path = typer.Argument(..., help="`.safetensors`, or anything else for `torch.save`."),
    tag: str | None = typer.Option(
        None, "--tag", help="Checkpoint tag (default: the `latest` one)."
    ),
) -> None:
    """Write the full fp32 state_dict of a sharded checkpoint to one file."""
    import torch

    from zcore.checkpoint import CheckpointError, atomic_path
    from zcore.checkpoint import consolidate as merge

    if not ckpt_dir.is_dir():
        raise _fail(f"`{ckpt_dir}` is not a directory; pass a run's `checkpoints/` folder")
    try:
        state = merge(str(ckpt_dir), tag)
    except CheckpointError as err:
        raise _fail(str(err)) from None
    seen: set[int] = set()
    params = 0
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:  # a tied alias: safetensors stores no shared memory
            if out.suffix == ".safetensors":
                state[name] = tensor.clone()
            continue
        seen.add(ptr)
        params += tensor.numel()
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        with atomic_path(out) as tmp:
            save_file(state, str(tmp), metadata={"format": "pt"})
    else:
        with atomic_path(out) as tmp:
            torch.save(state, tmp)
    size = out.stat().st_size
    typer.echo(
        f"wrote `{out}`: {len(state)} tensors, {params:,} parameters, {size / 2**20:.1f} MiB"
    )


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add `z train`, `z generate` and `z checkpoint consolidate` (nothing to `z bench`)."""
    app.command("train")(train)
    app.command("generate")(generate)
    checkpoint_app.command("consolidate")(consolidate)
    app.add_typer(checkpoint_app, name="checkpoint")
