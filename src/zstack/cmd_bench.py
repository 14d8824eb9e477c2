"""`z bench adam|adam-cuda|zero|zero-step|offload|io|moe|comm|speculative|efficiency|hf-trainer`:
benchmarks of `benchmarks/`.

Imports only typer and the standard library at load time; each benchmark module loads
through `zstack.bench` when its command runs. (`z bench serve` lives in `cmd_serve`,
`z bench quant` in `cmd_quant`.)
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer


class AdamDtype(str, Enum):
    """Optimizer-state precision of `z bench adam`."""

    fp32 = "fp32"
    bf16_states = "bf16-states"


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


def bench_adam_cuda(
    hidden: int = typer.Option(1024, "--hidden", min=1, help="GPT width of the parameter list."),
    layers: int = typer.Option(24, "--layers", min=1, help="GPT layers (12 tensors each)."),
    vocab: int = typer.Option(50304, "--vocab", min=1, help="Embedding rows."),
    rounds: int = typer.Option(10, "--rounds", min=1, help="Interleaved rounds (medians)."),
    burst: int = typer.Option(10, "--burst", min=1, help="Steps queued back to back per timing."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """Time FusedAdamCUDA against torch's fused/foreach Adam (and DeepSpeed's FusedAdam if
    importable) on a GPT's parameters, beside the GPU's copy bandwidth. Needs a CUDA device."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark(
            "adam_cuda",
            json_out,
            hidden=hidden,
            layers=layers,
            vocab=vocab,
            rounds=rounds,
            burst=burst,
        )
    )


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


def bench_zero_step(
    preset: str = typer.Option("medium", "--preset", help="`z train` GPT size."),
    stages: str = typer.Option("1,2,3", "--stages", help="Comma-separated ZeRO stages."),
    steps: int = typer.Option(5, "--steps", min=1, help="Timed steps per run (median reported)."),
    warmup: int = typer.Option(2, "--warmup", min=0),
    rounds: int = typer.Option(1, "--rounds", min=1, help="Alternating ours/DeepSpeed runs."),
    micro_batch: int = typer.Option(4, "--micro-batch", min=1),
    seq: int | None = typer.Option(
        None, "--seq", min=1, help="Tokens per sequence (default: the preset's, at most 256)."
    ),
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


def bench_moe(
    tokens: int = typer.Option(4096, "--tokens", min=2, help="Tokens per step (T)."),
    d_model: int = typer.Option(256, "--d-model", min=1, help="Hidden size (d)."),
    ffn: int = typer.Option(1024, "--ffn", min=1, help="Hidden size of one expert."),
    experts: int = typer.Option(8, "--experts", min=2, help="Experts (even)."),
    k: int = typer.Option(2, "--k", min=1, help="Experts per token (top-k)."),
    capacity_factor: float = typer.Option(1.25, "--capacity-factor", min=0.01),
    threads: int = typer.Option(2, "--threads", min=1, help="torch CPU threads."),
    repeats: int = typer.Option(9, "--repeats", min=1, help="Interleaved steps per contender."),
    warmup: int = typer.Option(1, "--warmup", min=0),
    no_ds: bool = typer.Option(False, "--no-ds", help="Skip DeepSpeed's MoE layer."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """Forward+backward tokens/s of zmoe.MoE next to a dense MLP and DeepSpeed's MoE layer."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark(
            "moe",
            json_out,
            tokens=tokens,
            d_model=d_model,
            ffn=ffn,
            experts=experts,
            k=k,
            capacity_factor=capacity_factor,
            threads=threads,
            repeats=repeats,
            warmup=warmup,
            deepspeed=not no_ds,
        )
    )


def bench_comm(
    rates: str = typer.Option(
        "100mbit", "--rates", help="Comma-separated tc rates of the link, e.g. 1gbit,100mbit."
    ),
    ranks: str = typer.Option("2,4", "--ranks", help="2 (1 rank per node), 4 (2 per node)."),
    steps: int = typer.Option(30, "--steps", min=2, help="Training steps per entry."),
    warmup: int = typer.Option(
        10, "--warmup", min=0, help="Untimed first steps; the 1-bit optimizers' freeze_step."
    ),
    entries: str | None = typer.Option(
        None, "--entries", help="Comma-separated subset, e.g. adam,onebit_adam,zero3,zeropp."
    ),
    preset: str = typer.Option("tiny", "--preset", help="`z train` GPT size."),
    seq_len: int = typer.Option(64, "--seq-len", min=8, help="Tokens per sequence."),
    micro_batch: int = typer.Option(4, "--micro-batch", min=1),
    loopback: bool = typer.Option(
        False, "--loopback", help="Skip the namespaces: unlimited loopback, bytes only."
    ),
    timeout_s: float = typer.Option(1800.0, "--timeout", min=10, help="Seconds per launch."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """Step time, bytes per step and loss of 1-bit Adam/0-1 Adam/1-bit LAMB vs Adam and
    ZeRO++ vs ZeRO-3 over an emulated slow link (network namespaces + `tc`; needs root)."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark(
            "comm",
            json_out,
            rates=rates,
            ranks=ranks,
            steps=steps,
            warmup=warmup,
            entries_=entries,
            preset=preset,
            seq_len=seq_len,
            micro_batch=micro_batch,
            loopback=loopback,
            timeout_s=timeout_s,
        )
    )


def bench_speculative(
    model_dir: str | None = typer.Argument(
        None, help="HF model directory (default: SmolLM2-135M-Instruct from `make setup`)."
    ),
    modes: str = typer.Option(
        "plain,ngram,self-draft", "--modes", help="Comma-separated: plain, ngram, self-draft."
    ),
    workloads: str = typer.Option("copy,chat", "--workloads", help="Comma-separated: copy, chat."),
    concurrency: str = typer.Option("1,4", "--concurrency", help="Comma-separated max_num_seqs."),
    num_prompts: int = typer.Option(4, "--num-prompts", min=1, help="Prompts per workload."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=2, help="Tokens generated per prompt."),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", min=1),
    prompt_lookup_max: int = typer.Option(4, "--prompt-lookup-max", min=1),
    prompt_lookup_min: int = typer.Option(2, "--prompt-lookup-min", min=1),
    draft_layers: int | None = typer.Option(
        None, "--draft-layers", min=1, help="Self-draft layers (default: the engine's)."
    ),
    threads: int = typer.Option(1, "--threads", min=1, help="torch threads."),
    temperature: float = typer.Option(
        0.0, "--temperature", min=0.0, help="0: greedy (outputs compared); > 0: sampled."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """zserve speculative decoding: plain vs n-gram vs self-draft on the same prompts —
    tokens/s, acceptance rate, accepted tokens per step, speedup, identical outputs."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark(
            "speculative",
            json_out,
            model_dir=model_dir,
            modes=modes,
            workloads_=workloads,
            concurrency=concurrency,
            num_prompts=num_prompts,
            max_tokens=max_tokens,
            num_speculative_tokens=num_speculative_tokens,
            prompt_lookup_max=prompt_lookup_max,
            prompt_lookup_min=prompt_lookup_min,
            draft_layers=draft_layers,
            threads=threads,
            temperature=temperature,
        )
    )


def bench_efficiency(
    sections: str = typer.Option(
        "curriculum",
        "--sections",
        help="Comma-separated: curriculum, random_ltd (deep GPT, plain vs random-LTD), admm (NxM sparsity by ADMM on MiniLM and SmolLM2, about ten minutes), scala (MiniLM comedy-vs-tragedy at batch 128, 3 seeds; tens of minutes).",
    ),
    steps: int = typer.Option(60, "--steps", min=2, help="Baseline optimizer steps."),
    preset: str = typer.Option("tiny", "--preset", help="`z train` GPT size."),
    seq_len: int = typer.Option(64, "--seq-len", min=8, help="Tokens per sequence."),
    micro_batch: int = typer.Option(8, "--micro-batch", min=1, help="Sequences per step."),
    lr: float = typer.Option(2e-3, "--lr", min=0.0, help="Peak learning rate (AdamW)."),
    lr_scale: float = typer.Option(4.0, "--lr-scale", min=1.0, help="Stability check: x lr."),
    min_seqlen: int = typer.Option(16, "--min-seqlen", min=8, help="Curriculum start length."),
    curriculum_frac: float = typer.Option(
        0.5, "--curriculum-frac", min=0.01, max=1.0, help="Share of the steps the ramp takes."
    ),
    evals: int = typer.Option(10, "--evals", min=1, help="Validation passes per run."),
    no_stability: bool = typer.Option(False, "--no-stability", help="Skip the x lr pair."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """Curriculum learning vs its baseline on `z train`'s GPT: tokens and time to the
    baseline's val loss, loss at equal tokens, and both at 4x the learning rate."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark(
            "efficiency",
            json_out,
            sections=sections,
            steps=steps,
            preset=preset,
            seq_len=seq_len,
            micro_batch=micro_batch,
            lr=lr,
            lr_scale=lr_scale,
            min_seqlen=min_seqlen,
            curriculum_frac=curriculum_frac,
            evals=evals,
            stability=not no_stability,
        )
    )


def bench_hf_trainer(
    model: str = typer.Option(
        str(Path.home() / ".cache/zstack/models/SmolLM2-135M-Instruct"),
        "--model",
        help="A Hugging Face LLaMA-family directory, or `tiny` (a random 2-layer one).",
    ),
    world_size: int = typer.Option(2, "--world-size", min=1, help="gloo ranks to spawn."),
    modes: str = typer.Option("zero2,zero3,lora3", "--modes", help="Comma-separated modes."),
    steps: int = typer.Option(5, "--steps", min=1, help="Timed steps (median reported)."),
    warmup: int = typer.Option(2, "--warmup", min=0),
    micro_batch: int = typer.Option(2, "--micro-batch", min=1),
    seq: int = typer.Option(128, "--seq", min=2, help="Tokens per sequence."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """zcore.hf.Trainer vs transformers' Trainer on DDP: step time and peak RSS per rank,
    full fine-tuning at ZeRO-2/3 and LoRA at ZeRO-3 (the JSON says why not DeepSpeed)."""
    from zstack.bench import run_benchmark

    raise typer.Exit(
        run_benchmark(
            "hf_trainer",
            json_out,
            model=model,
            world_size=world_size,
            modes=modes,
            steps=steps,
            warmup=warmup,
            micro_batch=micro_batch,
            seq=seq,
        )
    )


def bench_tp(
    preset: str = typer.Option("small", "--preset", help="z train's GPT preset (untied head)."),
    steps: int = typer.Option(20, "--steps", min=1, help="Timed steps per contender."),
    warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed first steps."),
    micro_batch: int = typer.Option(8, "--micro-batch", min=2, help="Global batch (even)."),
    seq_len: int = typer.Option(128, "--seq-len", min=1, help="Tokens per sequence."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """tp 2 step time vs DTensor's parallelize_module and data parallelism; state per rank."""
    from zstack.bench import run_benchmark

    options = dict(preset=preset, steps=steps, warmup=warmup, micro_batch=micro_batch)
    raise typer.Exit(run_benchmark("tp", json_out, seq_len=seq_len, **options))


def bench_pipe(
    steps: int = typer.Option(9, "--steps", min=1, help="Timed steps per contender."),
    warmup: int = typer.Option(2, "--warmup", min=0, help="Untimed first steps."),
    micro_batches: int = typer.Option(8, "--micro-batches", min=2, help="Per step (even)."),
    seq: int = typer.Option(128, "--seq", min=2, help="Tokens per micro-batch sequence."),
    zbv: bool = typer.Option(True, "--zbv/--no-zbv", help="Also time ZB-V with checkpointing."),
    layers: int = typer.Option(6, "--layers", min=2, help="GPT blocks."),
    width: int = typer.Option(576, "--width", min=8, help="Model width (8 heads)."),
    vocab: int = typer.Option(2048, "--vocab", min=2, help="Vocabulary size."),
    memory: bool = typer.Option(True, "--memory/--no-memory", help="Peak RSS runs alone."),
    json_out: bool = typer.Option(False, "--json", help="Print only the JSON object."),
) -> None:
    """Pipeline (2 stages) vs torch's Schedule1F1B and DDP: step time, bubble, memory."""
    from zstack.bench import run_benchmark

    options = dict(steps=steps, warmup=warmup, micro_batches=micro_batches, seq=seq, zbv=zbv)
    shape = dict(layers=layers, width=width, vocab=vocab, memory=memory)
    raise typer.Exit(run_benchmark("pipe", json_out, **options, **shape))


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add this module's commands to `z bench` (nothing to `z`)."""
    bench_app.command("adam")(bench_adam)
    bench_app.command("adam-cuda")(bench_adam_cuda)
    bench_app.command("zero")(bench_zero)
    bench_app.command("zero-step")(bench_zero_step)
    bench_app.command("offload")(bench_offload)
    bench_app.command("io")(bench_io)
    bench_app.command("moe")(bench_moe)
    bench_app.command("comm")(bench_comm)
    bench_app.command("speculative")(bench_speculative)
    bench_app.command("efficiency")(bench_efficiency)
    bench_app.command("hf-trainer")(bench_hf_trainer)
    bench_app.command("tp")(bench_tp)
    bench_app.command("pipe")(bench_pipe)
