"""`z train`: the GPT of `gpt.py` on Shakespeare under the zcore ZeRO engine, on every rank.

A run directory holds everything one run writes::

    metrics.jsonl            one record per step (rank 0)
    loss.png                 train and val loss against step
    checkpoints/<tag>/       the sharded engine checkpoint (`engine.save_checkpoint`)
    checkpoints/model.json   GPTConfig and tokenizer beside it, so the checkpoint alone
    checkpoints/tokenizer.json   can be consolidated and sampled
    export/                  consolidated fp32 weights + model.json + tokenizer.json

Batches are indexed by step (`TokenStream.get_micro_batch`), so `--resume` continues the
exact batch sequence. The default config is ZeRO stage 3, AdamW, WarmupCosineLR and
clipping 1.0; with `--config` the file's keys win and the flags fill in what it leaves out.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The default run (small, 2 ranks x 8 x 256 tokens) took 4:47 wall, 262 s of it training, on
# 2 CPU cores shared with other jobs; val loss 7.62 -> 5.08.
DEFAULT_STEPS = 150
VAL_BATCHES = 4
"""Micro-batches per rank in each validation pass (the same windows every time)."""
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_PRECISION_KEYS = ("fp16", "bf16", "bfloat16")


class TrainError(Exception):
    """A run that cannot start as asked; the message says what to change."""


@dataclass(frozen=True)
class TrainOptions:
    """The `z train` flags (see `z train --help`)."""

    out: Path = Path("runs/shakespeare")
    preset: str = "small"
    steps: int = DEFAULT_STEPS
    """Optimizer steps of the whole run; `--resume` trains from the checkpoint's step to this."""
    stage: int = 3
    config: Path | None = None
    resume: bool = False
    micro_batch: int = 8
    grad_accum: int = 1
    seq_len: int = 256
    lr: float = 1e-3
    eval_every: int | None = None
    """Steps between validation passes; None: a tenth of `steps`."""
    seed: int = 0
    vocab_size: int = 2048
    bf16: bool = False
    save_every: int = 0
    """Steps between checkpoints; 0 saves at the end only."""
    explicit: frozenset[str] = field(default_factory=frozenset)
    """Option names given on the command line (only those are reported as overridden)."""

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    @property
    def eval_interval(self) -> int:
        return self.eval_every or max(1, self.steps // 10)


def cache_dir() -> Path:
    """Tokenizer and encoded-corpus cache: `$ZSTACK_CACHE` or `~/.cache/zstack/shakespeare`."""
    env = os.environ.get("ZSTACK_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "zstack" / "shakespeare"


# -- config ---------------------------------------------------------------------------------
def default_config(opts: TrainOptions, scheduler_start: int = 0) -> dict[str, Any]:
    """The DeepSpeed config the flags describe; the scheduler resumes at `scheduler_start`."""
    warmup = max(1, min(100, opts.steps // 20))
    return {
        "train_micro_batch_size_per_gpu": opts.micro_batch,
        "gradient_accumulation_steps": opts.grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": max(opts.steps, 1),
        "zero_optimization": {"stage": opts.stage},
        "bf16": {"enabled": opts.bf16},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": opts.lr, "betas": [0.9, 0.95], "weight_decay": 0.1},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": max(opts.steps, warmup + 1),
                "warmup_num_steps": warmup,
                "warmup_type": "linear",
                "warmup_min_ratio": 0.1,
                "cos_min_ratio": 0.1,
                "last_batch_iteration": scheduler_start - 1,
            },
        },
    }


def _merge(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """`theirs` over `ours`; blocks that only make sense whole are taken whole from `theirs`."""
    out = dict(ours)
    if any(k in theirs for k in _BATCH_KEYS):
        for k in _BATCH_KEYS:
            out.pop(k, None)
    if any(k in theirs for k in _PRECISION_KEYS):
        for k in _PRECISION_KEYS:
            out.pop(k, None)
    for key, value in theirs.items():
        if key == "zero_optimization" and isinstance(value, dict):
            out[key] = {**out.get(key, {}), **value}
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class RunConfig:
    """The engine config of a run and what `z train` reports about it."""

    config: Any
    """The checked `ZConfig`."""
    as_dict: dict[str, Any]
    """What `zcore.initialize` gets."""
    notes: list[str]
    """One line per flag given on the command line that the `--config` file overrides."""
    own_scheduler: bool
    """The schedule is `default_config`'s (rebuilt for `--steps` on resume, not loaded)."""


def build_config(opts: TrainOptions, world_size: int, scheduler_start: int = 0) -> RunConfig:
    """The flags' config, or the `--config` file over it; raises ConfigError."""
    from zcore.config import ConfigError, ZConfig

    ours = default_config(opts, scheduler_start)
    if opts.config is None:
        cfg = ZConfig.load(ours)
        cfg.batch_sizes(world_size)
        return RunConfig(cfg, ours, [], own_scheduler=True)
    ZConfig.load(opts.config)  # the file's own problems, named with its path
    theirs = json.loads(Path(opts.config).read_text(encoding="utf-8"))
    merged = _merge(ours, theirs)
    try:
        cfg = ZConfig.load(merged)
        batch = cfg.batch_sizes(world_size)
    except ConfigError as err:
        raise ConfigError(err.problems, f"{opts.config} (with the `z train` flags)") from None
    effective = {
        "micro_batch": ("train_micro_batch_size_per_gpu", batch.micro_batch_size),
        "grad_accum": ("gradient_accumulation_steps", batch.gradient_accumulation_steps),
        "stage": ("zero_optimization.stage", cfg.zero_optimization.stage),
        "bf16": ("bf16.enabled", cfg.precision == "bf16"),
        "lr": ("optimizer.params.lr", cfg.optimizer.params.lr if cfg.optimizer else opts.lr),
    }
    notes = [
        f"`--{name.replace('_', '-')} {getattr(opts, name)}` is overridden by `{opts.config}`: "
        f"{key} = {value}"
        for name, (key, value) in effective.items()
        if name in opts.explicit and value != getattr(opts, name)
    ]
    return RunConfig(cfg, merged, notes, own_scheduler="scheduler" not in theirs)


# -- checks before any rank starts ----------------------------------------------------------
def checkpoint_step(ckpt_dir: Path) -> int:
    """The step of the `latest` checkpoint in `ckpt_dir`; TrainError when there is none."""
    latest = ckpt_dir / "latest"
    manifest = ckpt_dir / latest.read_text().strip() / "manifest.json" if latest.is_file() else None
    if manifest is None or not manifest.is_file():
        raise TrainError(
            f"no checkpoint to resume in `{ckpt_dir}` (no `latest` checkpoint); "
            f"run `z train --out {ckpt_dir.parent}` without `--resume` first"
        )
    return int(json.loads(manifest.read_text())["global_steps"])


def preflight(opts: TrainOptions, world_size: int) -> list[str]:
    """Everything that can be checked before starting ranks; returns the config notes.

    Raises ConfigError (bad `--config`) or TrainError (the message says what to change).
    """
    start = checkpoint_step(opts.checkpoints) if opts.resume else 0
    notes = build_config(opts, world_size, start).notes
    from zstack.recipes.data import plays_dir
    from zstack.recipes.gpt import PRESETS, GPTConfig

    try:
        plays_dir()
    except FileNotFoundError as err:
        raise TrainError(str(err)) from None
    if opts.preset not in PRESETS:
        raise TrainError(f"unknown `--preset {opts.preset}`; choose one of {sorted(PRESETS)}")
    block = PRESETS[opts.preset]["block_size"]
    if opts.seq_len > block:
        raise TrainError(
            f"`--seq-len {opts.seq_len}` exceeds preset {opts.preset}'s block_size {block}; "
            f"pass `--seq-len {block}` or less"
        )
    if opts.resume:
        if start >= opts.steps:
            raise TrainError(
                f"the checkpoint in `{opts.checkpoints}` is at step {start}; "
                f"`--steps {opts.steps}` leaves nothing to train, pass `--steps` above {start}"
            )
        saved = GPTConfig.from_dict(json.loads((opts.checkpoints / "model.json").read_text()))
        if saved != GPTConfig.preset(opts.preset, vocab_size=saved.vocab_size):
            names = [n for n in PRESETS if GPTConfig.preset(n, saved.vocab_size) == saved]
            fix = f"pass `--preset {names[0]}`" if names else "pass the preset it was trained with"
            raise TrainError(
                f"`{opts.checkpoints}` holds a model with {saved.n_layer} layers of width "
                f"{saved.n_embd}, not preset {opts.preset}; {fix}"
            )
    return notes


# -- the run --------------------------------------------------------------------------------
@dataclass
class _Dist:
    """The few collectives the loop needs; no-ops on one process."""

    rank: int
    world: int

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def mean(self, value: float) -> float:
        return sum(self.gather(value)) / self.world

    def gather(self, *values: float) -> list[float]:
        """Every rank's `values`, rank-major, flattened (an all-gather of one small tensor)."""
        if self.world == 1:
            return list(values)
        import torch
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return torch.cat(out).tolist()


def _threads_per_rank() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _load_data(opts: TrainOptions) -> tuple[Any, Any]:
    from zstack.recipes.data import ShakespeareData, load_plays
    from zstack.recipes.tokenizer import Tokenizer, train_or_load

    plays = load_plays()
    saved = opts.checkpoints / "tokenizer.json"
    if opts.resume and saved.is_file():
        tokenizer = Tokenizer.load(saved)
    else:
        tokenizer = train_or_load(cache_dir(), opts.vocab_size, plays)
    return tokenizer, ShakespeareData.load(tokenizer, cache_dir(), plays)


def _param_groups(model: Any) -> list[dict[str, Any]]:
    """No weight decay on biases, LayerNorms (1-D) and position embeddings, as in nanoGPT."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "wpe" not in name else plain).append(p)
    return [{"params": decay}, {"params": plain, "weight_decay": 0.0}]


def _restart_metrics(path: Path, resume_step: int | None) -> None:
    """Start `metrics.jsonl` afresh, or keep the records up to `resume_step` (a resumed run
    rewrites the steps after its checkpoint, and measures that step's val loss again)."""
    from zcore.checkpoint.files import save_text
    from zstack.recipes.metrics import read_jsonl

    kept = []
    if resume_step is not None and path.is_file():
        for record in read_jsonl(path):
            if record.get("step", 0) < resume_step:
                kept.append(record)
            elif record.get("step") == resume_step and "loss" in record:
                kept.append({k: v for k, v in record.items() if k != "val_loss"})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept), path)


@dataclass
class _Run:
    """What the loop works with, built by `_setup` on every rank."""

    opts: TrainOptions
    comm: _Dist
    engine: Any
    gpt_config: Any
    tokenizer: Any
    data: Any
    precision: str

    @property
    def tokens_per_step(self) -> int:
        return self.engine.batch.train_batch_size * self.opts.seq_len

    def evaluate(self) -> float:
        """Mean loss over the fixed validation windows, averaged over ranks (collective)."""
        import torch

        val, b = self.data.stream("val", self.opts.seq_len, self.opts.seed), self.engine.batch
        self.engine.eval()
        with torch.no_grad():
            total = sum(
                self.engine(
                    *val.get_micro_batch(i, 0, self.comm.rank, b.world_size, b.micro_batch_size, 1)
                )[1].item()
                for i in range(VAL_BATCHES)
            )
        self.engine.train()
        return self.comm.mean(total / VAL_BATCHES)

    def train_step(self, step: int) -> float:
        """One optimizer step on the global batch `step`; this rank's mean micro-batch loss."""
        train, b = self.data.stream("train", self.opts.seq_len, self.opts.seed), self.engine.batch
        total = 0.0
        for micro in range(b.gradient_accumulation_steps):
            x, y = train.get_micro_batch(
                step,
                micro,
                self.comm.rank,
                b.world_size,
                b.micro_batch_size,
                b.gradient_accumulation_steps,
            )
            _, loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()
            total += loss.item()
        return total / b.gradient_accumulation_steps

    def save(self) -> str:
        """The sharded checkpoint (collective), with model.json and tokenizer.json beside it."""
        from zcore.checkpoint.files import save_text

        ckpt = self.opts.checkpoints
        if self.comm.rank == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
            save_text(json.dumps(self.gpt_config.to_dict(), indent=2) + "\n", ckpt / "model.json")
            self.tokenizer.save(ckpt / "tokenizer.json")
        client_state = {
            "step": self.engine.global_steps,
            "preset": self.opts.preset,
            "seed": self.opts.seed,
            "seq_len": self.opts.seq_len,
            "tokenizer": str(ckpt / "tokenizer.json"),
        }
        return self.engine.save_checkpoint(str(ckpt), client_state=client_state)


def _setup(opts: TrainOptions) -> _Run:
    import torch

    import zcore
    from zcore.comm.groups import init_distributed
    from zstack.recipes.gpt import GPT, GPTConfig

    torch.set_num_threads(_threads_per_rank())
    if init_distributed(1800.0, backend="gloo"):
        import torch.distributed as dist

        comm = _Dist(dist.get_rank(), dist.get_world_size())
    else:
        comm = _Dist(0, 1)
    start = checkpoint_step(opts.checkpoints) if opts.resume else 0
    rc = build_config(opts, comm.world, start)
    # Rank 0 fills the tokenizer and token caches; the others then only read them.
    if comm.rank == 0:
        tokenizer, data = _load_data(opts)
    comm.barrier()
    if comm.rank != 0:
        tokenizer, data = _load_data(opts)
    gpt_config = GPTConfig.preset(opts.preset, vocab_size=tokenizer.vocab_size)
    model = GPT(gpt_config, seed=opts.seed)
    engine, *_ = zcore.initialize(model, model_parameters=_param_groups(model), config=rc.as_dict)
    if opts.resume:
        engine.load_checkpoint(str(opts.checkpoints), load_lr_scheduler_states=not rc.own_scheduler)
        if rc.own_scheduler:  # the loaded param groups carry the old schedule's lr
            lrs = engine.lr_scheduler.get_last_lr()
            for group, lr in zip(engine.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
    return _Run(opts, comm, engine, gpt_config, tokenizer, data, rc.config.precision)


def run(opts: TrainOptions, echo: Callable[[str], None] = print) -> int:
    """Train on this rank (every rank of the job calls it); returns the exit code."""
    from zcore.checkpoint import consolidate
    from zstack.recipes.generate import export_dir
    from zstack.recipes.metrics import JsonlWriter, plot_loss_curve, read_jsonl
    from zstack.recipes.progress import TrainProgress, rss_bytes

    r = _setup(opts)
    engine, comm, rank0 = r.engine, r.comm, r.comm.rank == 0
    first, b = engine.global_steps, engine.batch
    metrics_path = opts.out / "metrics.jsonl"
    if rank0:
        _restart_metrics(metrics_path, first if opts.resume else None)
        echo(
            f"training GPT {opts.preset} ({r.gpt_config.num_params() / 1e6:.1f}M params) on "
            f"{comm.world} rank(s), ZeRO stage {engine.stage}, {r.precision}: steps {first} -> "
            f"{opts.steps}, batch {b.world_size}x{b.micro_batch_size}x"
            f"{b.gradient_accumulation_steps} x {opts.seq_len} tokens"
        )
    writer = JsonlWriter(metrics_path) if rank0 else None
    print_every = max(1, (opts.steps - first) // 20)
    t_start, train_time, window = time.perf_counter(), 0.0, [0, 0.0]
    with TrainProgress(opts.steps, enabled=rank0) as progress:
        val_loss = r.evaluate()
        progress.log(f"step {first}: val loss {val_loss:.4f}")
        if writer is not None:
            writer.write({"step": first, "val_loss": val_loss})
        for step in range(first, opts.steps):
            t0, lr = time.perf_counter(), engine.get_lr()[0]
            loss = r.train_step(step)
            gathered = comm.gather(loss, rss_bytes() / 2**20)  # [loss_r0, rss_r0, loss_r1, ...]
            dt = time.perf_counter() - t0
            train_time += dt
            window[0], window[1] = window[0] + 1, window[1] + dt
            done, loss, rss = step + 1, sum(gathered[0::2]) / comm.world, gathered[1::2]
            record: dict[str, Any] = {
                "step": done,
                "loss": loss,
                "lr": lr,
                "grad_norm": engine.get_global_grad_norm(),
                "tokens_per_s": r.tokens_per_step / dt,
                "rank_rss_mib": rss,
            }
            val = None
            if done % opts.eval_interval == 0 or done == opts.steps:
                val = record["val_loss"] = r.evaluate()
                progress.log(f"step {done}: val loss {val:.4f}")
            record["elapsed_s"] = time.perf_counter() - t_start
            if writer is not None:
                writer.write(record)
            if progress.live or val is not None or done % print_every == 0:
                tps = r.tokens_per_step * window[0] / window[1]
                progress.update(
                    step=done, loss=loss, tokens_per_s=tps, rank_rss_mib=rss, val_loss=val
                )
                window = [0, 0.0]
            if opts.save_every and done % opts.save_every == 0 and done < opts.steps:
                r.save()
    if writer is not None:
        writer.close()
    path = r.save()
    if rank0:
        export = opts.out / "export"
        export_dir(consolidate(str(opts.checkpoints)), r.gpt_config, r.tokenizer, export)
        png = plot_loss_curve(
            metrics_path, opts.out / "loss.png", f"GPT {opts.preset} on Shakespeare"
        )
        vals = [
            (rec["step"], rec["val_loss"]) for rec in read_jsonl(metrics_path) if "val_loss" in rec
        ]
        tps = r.tokens_per_step * (opts.steps - first) / train_time if train_time else 0.0
        echo(
            f"done: steps {first} -> {opts.steps} in {time.perf_counter() - t_start:.0f} s, "
            f"{tps:,.0f} tokens/s over all ranks; val loss {vals[0][1]:.4f} (step {vals[0][0]}) "
            f"-> {vals[-1][1]:.4f} (step {vals[-1][0]})\n"
            f"  metrics     {metrics_path}\n  loss curve  {png}\n  checkpoint  {path}\n"
            f"  export      {export}\n"
            f'next: `z generate --checkpoint {opts.out} --prompt "ROMEO:"`'
        )
    engine.destroy()
    if comm.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0
