"""`z train --pp P --tp T`: the layout checked before any rank starts, and the model on it.

`plan_layout` turns the flags into a `Layout` (or a `TrainError` naming every number and the
fix); `build_engine` makes the run's model and engine on it:

- `pp 1, tp 1`: `z train`'s GPT under ZeRO over every rank;
- `tp > 1`: the GPT cut over `tp` by zcore's `gpt` plan (ZeRO over the `dp` ranks left);
- `pp > 1`: the GPT as pipeline layers (`ztrain.gpt_pipe`), each stage's layers cut over
  `tp`, run by `engine.train_batch` / `eval_batch` (`pipe_train_step`, `pipe_evaluate`).

The job has `pp x tp x dp` ranks; a step reads `micro_batch x microbatches` sequences per
data-parallel rank (`--microbatches` is `gradient_accumulation_steps`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ztrain.train_options import TrainError, TrainOptions

PIPE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


@dataclass(frozen=True)
class Layout:
    """How a run's ranks are laid out: pipeline stages x tensor-parallel ranks x the rest."""

    pp: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    """Micro-batches per optimizer step (`gradient_accumulation_steps`)."""
    cp: int = 1
    """Ranks sharing each sequence (`--cp`, `sequence_parallel_size`)."""

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def parallel(self) -> bool:
        """Anything but plain data parallelism."""
        return self.pp > 1 or self.tp > 1 or self.cp > 1

    def describe(self, world: int) -> str:
        text = f"pp {self.pp} x tp {self.tp} x dp {world // (self.pp * self.tp * self.cp)}"
        text += f" x cp {self.cp}" if self.cp > 1 else ""
        return (
            f"{text}, {self.schedule} over {self.microbatches} micro-batches"
            if self.pp > 1
            else text
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def plan_layout(opts: TrainOptions, world: int) -> tuple[Layout, TrainOptions, list[str]]:
    """The layout `opts` ask for on `world` ranks, the options as the run uses them (ZeRO
    stage, accumulation steps), and notes; raises `TrainError` naming the fix."""
    from ztrain.gpt import PRESETS
    from ztrain.gpt_cp import plan_cp

    pp, tp, given = opts.pp, opts.tp, opts.explicit
    cp = plan_cp(opts, world)
    if pp == 1 and tp == 1:
        if given & {"schedule", "microbatches"}:
            raise TrainError("`--schedule` and `--microbatches` are pipeline flags; add `--pp 2`")
        return Layout(cp=cp), opts, []
    if world % (pp * tp):
        fits = world - world % (pp * tp)
        raise TrainError(
            f"`--nproc {world}` is not divisible by `--pp {pp}` x `--tp {tp}` = {pp * tp}: "
            f"each data-parallel replica takes pp x tp ranks; pass `--nproc {pp * tp}`"
            + (f" (or {fits})" if fits > pp * tp else "")
            + ", or change `--pp`/`--tp`"
        )
    if opts.moe or opts.dense_twin:
        raise TrainError(
            "`--pp`/`--tp` with `--moe` is not built (MoE layers are cut over experts, not "
            "tensor- or pipeline-parallel ranks); drop `--pp`/`--tp` and use `--moe-ep`"
        )
    preset = PRESETS.get(opts.preset)
    if preset is None:
        raise TrainError(f"unknown `--preset {opts.preset}`; choose one of {sorted(PRESETS)}")
    problems = []
    if preset["n_head"] % tp:
        problems.append(
            f"preset {opts.preset} has n_head {preset['n_head']}, not divisible by `--tp {tp}`; "
            f"choose a `--tp` that divides it ({_divisors(preset['n_head'])})"
        )
    if opts.vocab_size % tp:
        up = opts.vocab_size + tp - opts.vocab_size % tp
        problems.append(
            f"`--vocab-size {opts.vocab_size}` is not divisible by `--tp {tp}`; pass a "
            f"multiple of {tp} (e.g. `--vocab-size {up}`)"
        )
    if problems:
        raise TrainError("; ".join(problems))
    if pp == 1:
        if given & {"schedule", "microbatches"}:
            raise TrainError("`--schedule` and `--microbatches` are pipeline flags; add `--pp 2`")
        return Layout(1, tp, microbatches=opts.grad_accum, cp=cp), opts, []
    return _plan_pipeline(opts, preset["n_layer"])


def _plan_pipeline(opts: TrainOptions, blocks: int) -> tuple[Layout, TrainOptions, list[str]]:
    pp, given, notes = opts.pp, opts.explicit, []
    if opts.schedule not in PIPE_SCHEDULES:
        why = (
            " (zbv cannot run the validation passes: its eval_batch is not built; "
            "`z bench pipe --zbv` times it)"
            if opts.schedule == "zbv"
            else ""
        )
        raise TrainError(
            f"`--schedule {opts.schedule}` is not one z train runs{why}; choose one of "
            f"{', '.join(PIPE_SCHEDULES)}"
        )
    virtual = 2 if opts.schedule == "interleaved_1f1b" else 1
    if pp * virtual > blocks:
        also = " x 2 stages per rank (interleaved_1f1b)" if virtual > 1 else ""
        raise TrainError(
            f"preset {opts.preset} has {blocks} transformer blocks but `--pp {pp}`{also} = "
            f"{pp * virtual} stages need one each; pass `--pp {max(1, blocks // virtual)}` or "
            "less, or a deeper preset (`--preset deep`: 12 blocks)"
        )
    if "microbatches" in given and "grad_accum" in given and opts.microbatches != opts.grad_accum:
        raise TrainError(
            f"`--microbatches {opts.microbatches}` and `--grad-accum {opts.grad_accum}` are the "
            "same setting under `--pp`; pass one of them"
        )
    micro = opts.microbatches or (opts.grad_accum if "grad_accum" in given else 2 * pp)
    if opts.schedule != "gpipe" and micro < pp:
        raise TrainError(
            f"schedule {opts.schedule} needs at least as many micro-batches as pipeline "
            f"stages: `--microbatches {micro}` < `--pp {pp}`; pass `--microbatches {pp}` or more"
        )
    rounds = max(1, micro // pp)
    if virtual > 1 and micro % rounds:
        raise TrainError(
            f"interleaved_1f1b runs micro-batches in rounds of `--pp {pp}`: `--microbatches "
            f"{micro}` is not a multiple of {rounds} rounds; pass a multiple of {pp}"
        )
    layout = Layout(pp, opts.tp, opts.schedule, micro)
    return layout, dataclasses.replace(opts, grad_accum=micro), notes


def param_groups(model: Any, rename: Any = None) -> list[dict[str, Any]]:
    """No weight decay on biases, LayerNorms (1-D) and position embeddings, as in nanoGPT;
    `rename` maps a parameter's name to `GPT`'s (a pipelined GPT's layers)."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        gpt = rename(name) if rename is not None else name
        (decay if p.dim() >= 2 and "wpe" not in gpt else plain).append(p)
    return [{"params": decay}, {"params": plain, "weight_decay": 0.0}]


def build_engine(plan: Any, model_config: Any, config: dict[str, Any]) -> Any:
    """The run's engine on `plan.layout` (module docstring), its model built from
    `model_config` at `plan.seed`."""
    import zcore
    from zcore.comm import MeshSpec
    from ztrain.moe_plan import build_model

    lay: Layout = plan.layout
    spec = None
    rename = None
    if lay.pipelined:
        from ztrain.gpt_pipe import build_pipe_gpt, gpt_name

        model = build_pipe_gpt(
            model_config, lay.pp, plan.seed, lay.schedule, partition_method="type:PipeBlock"
        )

        def rename(name: str) -> str:
            return gpt_name(name, model_config.n_layer)

    else:
        model = build_model(model_config, seed=plan.seed)
    if lay.pp > 1 or lay.tp > 1:
        spec = MeshSpec.resolve(plan.world_size, pp=lay.pp, tp=lay.tp, cp=lay.cp)
    if lay.tp > 1:
        from zcore.tensor import parallelize

        parallelize(model, spec)  # before the param groups, which hold the shards
    if lay.cp > 1:  # after the tp cut: each tp rank's heads span the cp ranks
        from ztrain.gpt_cp import sequence_parallel

        sequence_parallel(model)
    groups = param_groups(model, rename)
    engine, *_ = zcore.initialize(model, model_parameters=groups, config=config, mesh=spec)
    return engine


def pipe_train_step(t: Any, step: int) -> float:
    """One `train_batch` of a pipelined run: the step's micro-batches, read lazily (only the
    first and last stages read them); the mean loss over the whole batch."""
    plan, engine = t.plan, t.engine
    train, b = t.data.stream("train", plan.seq_len, plan.seed), engine.batch
    seq_len = t.curriculum.begin_step(step)
    t.last_tokens = int(b.train_batch_size * seq_len)
    t.tokens_seen += t.last_tokens
    micro = (
        t.curriculum.micro_batch(train, step, m, engine.data_rank, b)
        for m in range(b.gradient_accumulation_steps)
    )
    return float(engine.train_batch(micro))


def pipe_evaluate(t: Any, batches: int) -> float:
    """The mean loss over the first `batches` validation windows per data rank (at least
    one `eval_batch` of `microbatches` windows)."""
    plan, engine = t.plan, t.engine
    val, b = t.data.stream("val", plan.seq_len, plan.seed), engine.batch
    m = b.gradient_accumulation_steps
    calls = max(1, -(-batches // m))
    total = 0.0
    for c in range(calls):
        micro = (
            val.get_micro_batch(c * m + i, 0, engine.data_rank, b.world_size, b.micro_batch_size, 1)
            for i in range(m)
        )
        total += float(engine.eval_batch(micro))
    return t.ranks.mean(total / calls)
