"""A `z train` run decided once: options checked, engine config built, first step found.

`plan_run` is the only reader of `TrainOptions` past the command line: the launcher calls
it to reject a bad run before any rank starts, each rank calls it again (the same options,
the same files), and everything after (`Trainer`, the loop) reads only the `TrainPlan`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ztrain.moe_plan import MoESpec, plan_moe
from ztrain.resume import find_resume_point
from ztrain.train_config import RunConfig, build_config
from ztrain.train_options import TrainError, TrainOptions
from ztrain.train_parallel import Layout, plan_layout


@dataclass(frozen=True)
class TrainPlan:
    """What one `z train` run does; built by `plan_run`."""

    out: Path
    """The run directory."""
    preset: str
    """GPT size (`ztrain.gpt.PRESETS`)."""
    steps: int
    """The optimizer step the run ends at."""
    start: int
    """The optimizer step the run starts at: 0, or the resumed checkpoint's."""
    resume_tag: str | None
    """The checkpoint in `checkpoints` to continue from (its weights, optimizer and the
    tokenizer beside it); None: a new run."""
    seq_len: int
    """Tokens per sequence: `--seq-len`, else the preset's default."""
    seed: int
    """Model init and batch order."""
    vocab_size: int
    """BPE vocabulary of a new tokenizer (a resumed run keeps the checkpoint's)."""
    eval_interval: int
    """Steps between validation passes."""
    save_every: int
    """Steps between checkpoints; 0 saves at the end only."""
    world_size: int
    config: RunConfig
    """The engine config and the notes about the flags it overrides."""
    warnings: tuple[str, ...] = ()
    """What to warn about before the run starts (a resume that skips an incomplete `latest`)."""
    moe: MoESpec | None = None
    """The Mixtral-architecture model to train (`--moe`, `--dense-twin`); None: the GPT."""
    moe_notes: tuple[str, ...] = ()
    layout: Layout = field(default_factory=Layout)
    """Pipeline stages x tensor-parallel ranks x data-parallel ranks (`--pp`, `--tp`)."""
    layout_notes: tuple[str, ...] = ()

    @property
    def resume(self) -> bool:
        return self.resume_tag is not None

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.out / "metrics.jsonl"

    @property
    def export(self) -> Path:
        return self.out / "export"

    @property
    def notes(self) -> list[str]:
        """What to tell the user before the run starts (flags a `--config` overrides)."""
        return [*self.config.notes, *self.moe_notes, *self.layout_notes]


def plan_run(opts: TrainOptions, world_size: int) -> TrainPlan:
    """Check `opts` for a job of `world_size` ranks and decide the run.

    Raises ConfigError (bad `--config`) or TrainError (the message says what to change).
    """
    layout, opts, layout_notes = plan_layout(opts, world_size)
    point = find_resume_point(opts.checkpoints) if opts.resume else None
    start = point.step if point else 0
    config = build_config(opts, world_size, start, layout)
    from ztrain.data import plays_dir
    from ztrain.gpt import PRESETS, default_seq_len

    try:
        plays_dir()
    except FileNotFoundError as err:
        raise TrainError(str(err)) from None
    if opts.preset not in PRESETS:
        raise TrainError(f"unknown `--preset {opts.preset}`; choose one of {sorted(PRESETS)}")
    block = PRESETS[opts.preset]["block_size"]
    seq_len = default_seq_len(opts.preset) if opts.seq_len is None else opts.seq_len
    if seq_len > block:
        raise TrainError(
            f"`--seq-len {seq_len}` exceeds preset {opts.preset}'s block_size {block}; "
            f"pass `--seq-len {block}` or less (or leave it out: {default_seq_len(opts.preset)})"
        )
    _check_curriculum(config, seq_len, layout)
    moe, moe_notes = plan_moe(opts, world_size, PRESETS[opts.preset]["n_layer"])
    if opts.resume:
        _check_resumable(opts, start, moe)
    return TrainPlan(
        out=opts.out,
        preset=opts.preset,
        steps=opts.steps,
        start=start,
        resume_tag=point.tag if point else None,
        seq_len=seq_len,
        seed=opts.seed,
        vocab_size=opts.vocab_size,
        eval_interval=opts.eval_interval,
        save_every=opts.save_every,
        world_size=world_size,
        config=config,
        warnings=(point.warning,) if point and point.warning else (),
        moe=moe,
        moe_notes=tuple(moe_notes),
        layout=layout,
        layout_notes=tuple(layout_notes),
    )


def _check_curriculum(config: RunConfig, seq_len: int, layout: Layout) -> None:
    """A sequence-length curriculum ends at `seq_len` at most (the windows' length), and
    runs without pipeline stages (whose shapes are static)."""
    from zcore.data_efficiency.config import parse_blocks

    _, legacy = parse_blocks(config.config)
    if legacy.enabled and layout.pipelined:
        raise TrainError(
            "a seqlen curriculum_learning block with `--pp`: pipeline stages have static "
            "activation shapes, so every micro-batch must keep `--seq-len`; drop the block "
            "or `--pp`"
        )
    if legacy.enabled and legacy.max_difficulty is not None and legacy.max_difficulty > seq_len:
        raise TrainError(
            f"curriculum_learning.max_difficulty {legacy.max_difficulty} exceeds `--seq-len "
            f"{seq_len}`: the curriculum cuts windows of --seq-len tokens; set "
            f"max_difficulty to {seq_len} or pass `--seq-len {legacy.max_difficulty}`"
        )


def _check_resumable(opts: TrainOptions, start: int, moe: MoESpec | None) -> None:
    """The checkpoint at `start` leaves steps to train and holds the model the flags ask for."""
    import dataclasses

    from ztrain.gpt import PRESETS
    from ztrain.moe_plan import config_from_dict, model_config

    if start >= opts.steps:
        raise TrainError(
            f"the checkpoint in `{opts.checkpoints}` is at step {start}; "
            f"`--steps {opts.steps}` leaves nothing to train, pass `--steps` above {start}"
        )
    saved = config_from_dict(json.loads((opts.checkpoints / "model.json").read_text()))
    wanted = model_config(opts.preset, saved.vocab_size, moe)
    if type(saved) is not type(wanted):
        what = "an MoE-architecture model" if moe is None else "a GPT"
        fix = "add `--moe` and its flags" if moe is None else "drop `--moe`/`--dense-twin`"
        raise TrainError(f"`{opts.checkpoints}` holds {what}; {fix}")
    if moe is not None:  # the expert-parallel size may change between runs
        saved = dataclasses.replace(saved, ep_size=wanted.ep_size)
        if saved != wanted:
            diff = [
                f"{f.name} {getattr(saved, f.name)} (flags: {getattr(wanted, f.name)})"
                for f in dataclasses.fields(saved)
                if getattr(saved, f.name) != getattr(wanted, f.name)
            ]
            raise TrainError(
                f"`{opts.checkpoints}` holds a different MoE model: {', '.join(diff)}; "
                "pass the flags it was trained with"
            )
        return
    if saved != wanted:
        names = [n for n in PRESETS if model_config(n, saved.vocab_size, None) == saved]
        fix = f"pass `--preset {names[0]}`" if names else "pass the preset it was trained with"
        raise TrainError(
            f"`{opts.checkpoints}` holds a model with {saved.n_layer} layers of width "
            f"{saved.n_embd}, not preset {opts.preset}; {fix}"
        )
