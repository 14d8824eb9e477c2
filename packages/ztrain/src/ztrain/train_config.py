"""The engine config of a `z train` run: the flags' DeepSpeed config, or `--config` over it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ztrain.train_options import TrainError, TrainOptions

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_PRECISION_KEYS = ("fp16", "bf16", "bfloat16")


def default_config(
    opts: TrainOptions, scheduler_start: int = 0, layout: Any = None
) -> dict[str, Any]:
    """The DeepSpeed config the flags describe; the scheduler resumes at `scheduler_start`;
    `layout` (a `train_parallel.Layout`) adds the `pipeline` and `tensor_parallel` blocks."""
    warmup = max(1, min(100, opts.steps // 20))
    blocks: dict[str, Any] = {}
    if layout is not None and layout.pp > 1:
        blocks["pipeline"] = {"schedule": layout.schedule}
    if layout is not None and layout.tp > 1:
        blocks["tensor_parallel"] = {"autotp_size": layout.tp}
    if layout is not None and layout.cp > 1:
        blocks["sequence_parallel_size"] = layout.cp
        blocks["sequence_parallel_mode"] = opts.cp_mode
    return {
        **blocks,
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


def build_config(
    opts: TrainOptions, world_size: int, scheduler_start: int = 0, layout: Any = None
) -> RunConfig:
    """The flags' config, or the `--config` file over it; raises ConfigError. The batch
    arithmetic counts the data-parallel ranks: `world_size / (pp x tp x cp)` under `layout`."""
    from zcore.config import ConfigError, ZConfig

    cp = 1 if layout is None else layout.cp
    if layout is not None:
        world_size //= layout.pp * layout.tp * cp
    ours = default_config(opts, scheduler_start, layout)
    if opts.config is None:
        cfg = ZConfig.load(ours)
        cfg.batch_sizes(world_size)
        return RunConfig(cfg, ours, [], own_scheduler=True)
    ZConfig.load(opts.config)  # the file's own problems, named with its path
    theirs = json.loads(Path(opts.config).read_text(encoding="utf-8"))
    merged = _merge(ours, theirs)
    try:
        cfg = ZConfig.load(merged)
        if cfg.sequence_parallel_size != cp:
            raise TrainError(
                f"`{opts.config}` sets sequence_parallel_size {cfg.sequence_parallel_size} "
                f"but the run has `--cp {cp}` (the model is split by the flag); pass "
                f"`--cp {cfg.sequence_parallel_size}`"
            )
        if cp > 1 and cfg.sequence_parallel_mode != opts.cp_mode:
            raise TrainError(
                f"`{opts.config}` sets sequence_parallel_mode {cfg.sequence_parallel_mode!r} "
                f"but the run has `--cp-mode {opts.cp_mode}`; pass "
                f"`--cp-mode {cfg.sequence_parallel_mode}`"
            )
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
