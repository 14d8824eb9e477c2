"""Training efficiency against its baseline, measured in the same run on `z train`'s GPT.

Each section is one function `section(o: Options, work: Path) -> dict` in `SECTIONS`; `z bench
efficiency --sections a,b` runs the ones asked for: `curriculum` (the default) and `admm`
(NxM sparsity by ADMM, `benchmarks/_admm_nm.py`), `random_ltd` (`benchmarks/_random_ltd.py`)
and `scala` (ScaLA against the same large-batch MiniLM fine-tune, `benchmarks/_scala.py`).

**curriculum** (DeepSpeed's legacy `curriculum_learning`, `curriculum_type: seqlen`): on
Shakespeare, one rank, in this process through `z train`'s own loop
(`ztrain.train.run`):

- *baseline*: `--steps` optimizer steps of `--micro-batch` windows of `--seq-len` tokens;
- *curriculum*: the same model, data order, optimizer and peak learning rate, each batch
  cut to the schedule's length (`fixed_linear` from `--min-seqlen` to `--seq-len` over
  `--curriculum-frac` of the run, multiples of 8), trained until it has seen the
  baseline's tokens (so it makes more, shorter steps; its cosine schedule spans them, as
  DeepSpeed's tutorial decays the learning rate by tokens).

Reported: the baseline's final validation loss (always at the full `--seq-len`), the tokens
and training seconds the curriculum needed to first reach it (validation every
`--eval-every` steps of the baseline's tokens), the ratio to the baseline's, and the
validation loss of both at equal tokens. Then the *stability* pair: both again at
`--lr-scale` times the learning rate, for as many steps as before, with their final
validation losses, the worst training-loss spike (the largest rise of the loss over its
running minimum) and whether the run diverged (non-finite loss, or a final validation loss
above the first). Training seconds are the sum of the steps' times (validation excluded).

Run: ``z bench efficiency --json`` (a few minutes on 2 CPU cores); ``--steps`` scales it.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Options:
    """What every section reads; each section takes the fields it needs."""

    steps: int = 60
    preset: str = "tiny"
    seq_len: int = 64
    micro_batch: int = 8
    lr: float = 2e-3
    lr_scale: float = 4.0
    min_seqlen: int = 16
    curriculum_frac: float = 0.5
    evals: int = 10
    stability: bool = True
    seed: int = 0


def _train(
    work: Path,
    name: str,
    o: Options,
    steps: int,
    lr: float,
    eval_every: int,
    config: dict[str, Any] | None,
) -> dict[str, Any]:
    """One `z train` run on one rank in this process; its metrics records, in step order."""
    from ztrain.metrics import read_jsonl
    from ztrain.train import run
    from ztrain.train_options import TrainOptions
    from ztrain.train_plan import plan_run

    out = work / name
    path = None
    if config is not None:
        path = work / f"{name}.json"
        path.write_text(json.dumps(config))
    opts = TrainOptions(
        out=out,
        preset=o.preset,
        steps=steps,
        stage=0,
        config=path,
        micro_batch=o.micro_batch,
        seq_len=o.seq_len,
        lr=lr,
        eval_every=eval_every,
        seed=o.seed,
    )
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        run(plan_run(opts, 1), echo=lambda line: None, report=False)
    records = read_jsonl(out / "metrics.jsonl")
    return {"records": records, "wall_s": time.perf_counter() - t0}


def _curve(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """(step, tokens, train_s, val_loss) at every validation pass; train_s sums the steps'
    times (each step's tokens over its tokens/s), validation excluded."""
    tokens, train_s, out = 0, 0.0, []
    for r in records:
        if "loss" in r:
            train_s += (r["tokens"] - tokens) / r["tokens_per_s"]
            tokens = r["tokens"]
        if "val_loss" in r:
            out.append(
                {"step": r["step"], "tokens": tokens, "train_s": train_s, "val_loss": r["val_loss"]}
            )
    return out


def _seqlen_config(o: Options, steps: int) -> dict[str, Any]:
    total = max(1, round(o.curriculum_frac * steps))
    return {
        "curriculum_learning": {
            "enabled": True,
            "curriculum_type": "seqlen",
            "min_difficulty": o.min_seqlen,
            "max_difficulty": o.seq_len,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": total, "difficulty_step": 8},
        }
    }


def _steps_for_tokens(o: Options, tokens: int) -> int:
    """Curriculum steps whose tokens first reach `tokens`; the schedule spans those steps."""
    from zcore.data_efficiency import CurriculumScheduler, LegacyCurriculumConfig

    steps = tokens // (o.micro_batch * o.seq_len)
    while True:  # the schedule's length depends on the step count: grow until it fits
        sched = CurriculumScheduler(
            LegacyCurriculumConfig.model_validate(_seqlen_config(o, steps)["curriculum_learning"])
        )
        seen = sum(
            o.micro_batch * min(o.seq_len, sched.difficulty_at(s)) for s in range(1, steps + 1)
        )
        if seen >= tokens:
            return steps
        steps += max(1, (tokens - seen) // (o.micro_batch * o.seq_len))


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    losses = [r["loss"] for r in records if "loss" in r]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    spike, low = 0.0, math.inf
    for loss in losses:
        low = min(low, loss)
        spike = max(spike, loss - low)
    finite = all(math.isfinite(x) for x in losses + vals)
    return {
        "final_val_loss": vals[-1],
        "max_loss_spike": spike,
        "diverged": not finite or vals[-1] > vals[0],
    }


def curriculum(o: Options, work: Path) -> dict[str, Any]:
    """Baseline vs the sequence-length curriculum: tokens and time to the baseline's final
    validation loss, loss at equal tokens, and the pair again at `lr_scale` x the rate."""
    eval_every = max(1, o.steps // o.evals)
    base = _train(work, "baseline", o, o.steps, o.lr, eval_every, None)
    base_curve = _curve(base["records"])
    target, base_tokens = base_curve[-1]["val_loss"], base_curve[-1]["tokens"]
    cl_steps = _steps_for_tokens(o, base_tokens)
    cl_eval = max(1, cl_steps // o.evals)  # as many validation passes as the baseline
    cl = _train(work, "curriculum", o, cl_steps, o.lr, cl_eval, _seqlen_config(o, cl_steps))
    cl_curve = _curve(cl["records"])
    reached = next((p for p in cl_curve if p["val_loss"] <= target), None)
    out: dict[str, Any] = {
        "baseline": {
            "steps": o.steps,
            "tokens": base_tokens,
            "train_s": base_curve[-1]["train_s"],
            "final_val_loss": target,
            "curve": base_curve,
        },
        "curriculum": {
            "steps": cl_steps,
            "tokens": cl_curve[-1]["tokens"],
            "train_s": cl_curve[-1]["train_s"],
            "final_val_loss": cl_curve[-1]["val_loss"],
            "schedule": _seqlen_config(o, cl_steps)["curriculum_learning"],
            "curve": cl_curve,
        },
        "to_baseline_loss": None,
        "val_loss_at_equal_tokens": {"baseline": target, "curriculum": cl_curve[-1]["val_loss"]},
    }
    if reached is not None:
        out["to_baseline_loss"] = {
            "step": reached["step"],
            "tokens": reached["tokens"],
            "token_ratio": reached["tokens"] / base_tokens,
            "tokens_saved": 1 - reached["tokens"] / base_tokens,
            "train_s": reached["train_s"],
            "time_ratio": reached["train_s"] / base_curve[-1]["train_s"],
        }
    # issue 22's bar: the baseline's loss with >= 20% fewer tokens, or lower loss at equal
    # tokens (a measurement, reported; `ok` is left for runs that fail)
    saved = reached is not None and reached["tokens"] <= 0.8 * base_tokens
    out["meets_target"] = saved or cl_curve[-1]["val_loss"] < target
    if o.stability:
        hot = replace(o, lr=o.lr * o.lr_scale)
        fast = _train(work, "baseline_hot", hot, o.steps, hot.lr, eval_every, None)
        slow = _train(
            work, "curriculum_hot", hot, o.steps, hot.lr, eval_every, _seqlen_config(hot, o.steps)
        )
        out["stability"] = {
            "lr": hot.lr,
            "steps": o.steps,
            "baseline": _summary(fast["records"]),
            "curriculum": _summary(slow["records"]),
        }
    return out


def admm(o: Options, work: Path) -> dict[str, Any]:
    """ADMM N:M against magnitude N:M (one-shot, and with the same fine-tuning) on MiniLM
    and SmolLM2 (`benchmarks/_admm_nm.py`); `--steps` / 2 ADMM steps. Opt-in (about ten
    minutes on 2 CPU cores): `--sections curriculum,admm`."""
    from zcore.bench import load

    return load("_admm_nm", Path(__file__).parent).admm_section(max(2, o.steps // 2))


def random_ltd(o: Options, work: Path) -> dict[str, Any]:
    """Random-LTD against the plain model, alternating steps in this process
    (`benchmarks/_random_ltd.py`): wall-clock and FLOPs per step saved, and the validation
    loss gap at equal tokens; `deep` preset at 4 x `--seq-len`. Opt-in:
    `--sections random_ltd`."""
    from zcore.bench import load

    return load("_random_ltd", Path(__file__).parent).random_ltd_section(o)


def scala(o: Options, work: Path) -> dict[str, Any]:
    """ScaLA against the same large-batch MiniLM fine-tune without it: steps to a held-out
    accuracy (95% of the baseline's own median final one) on which-of-six-plays Shakespeare
    lines at batch 512 over seeds 0-4, at the settings `benchmarks/_scala_sweep.py` picked on
    tuning seeds; 48 steps per run at the default `--steps` 60 (scaled with it). On the GPU
    when there is one (under a minute); opt-in, as on 2 CPU cores it takes hours:
    `--sections curriculum,scala`."""
    from zcore.bench import load

    return load("_scala", Path(__file__).parent).scala_section(
        max_steps=max(8, 48 * o.steps // 60), seed=o.seed
    )


SECTIONS: dict[str, Callable[[Options, Path], dict[str, Any]]] = {
    "curriculum": curriculum,
    "admm": admm,
    "random_ltd": random_ltd,
    "scala": scala,
}


def run(sections: str = "curriculum", **options: Any) -> dict[str, Any]:
    """Run the asked sections; the result holds each one's dict and the options."""
    names = [s.strip() for s in sections.split(",") if s.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise ValueError(
            f"--sections {sections!r}: unknown {unknown}; choose from {', '.join(SECTIONS)}"
        )
    o = Options(**options)
    if o.min_seqlen % 8 or not 8 <= o.min_seqlen <= o.seq_len:
        raise ValueError(
            f"--min-seqlen {o.min_seqlen}: must be a multiple of 8 between 8 and --seq-len "
            f"{o.seq_len}"
        )
    result: dict[str, Any] = {"benchmark": "efficiency", "options": o.__dict__}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="z-bench-efficiency-") as tmp:
        for name in names:
            result[name] = SECTIONS[name](o, Path(tmp))
    result["wall_s"] = time.perf_counter() - t0
    return result


def report(result: dict[str, Any]) -> str:
    lines = [f"z bench efficiency ({result['wall_s']:.0f} s)"]
    c = result.get("curriculum")
    if c is not None:
        b, cl = c["baseline"], c["curriculum"]
        lines.append(
            f"curriculum (seqlen {cl['schedule']['min_difficulty']} -> "
            f"{cl['schedule']['max_difficulty']} over "
            f"{cl['schedule']['schedule_config']['total_curriculum_step']} steps)"
        )
        lines.append(
            f"  baseline    {b['steps']} steps, {b['tokens']:,} tokens, {b['train_s']:.1f} s: "
            f"val loss {b['final_val_loss']:.4f}"
        )
        lines.append(
            f"  curriculum  {cl['steps']} steps, {cl['tokens']:,} tokens, {cl['train_s']:.1f} s: "
            f"val loss {cl['final_val_loss']:.4f} (at equal tokens)"
        )
        r = c["to_baseline_loss"]
        if r is None:
            lines.append("  the curriculum never reached the baseline's final val loss")
        else:
            lines.append(
                f"  to the baseline's val loss: {r['tokens']:,} tokens ({r['tokens_saved']:.0%} "
                f"fewer), {r['train_s']:.1f} s ({r['time_ratio']:.2f}x the baseline's time)"
            )
        s = c.get("stability")
        if s is not None:
            for name in ("baseline", "curriculum"):
                x = s[name]
                lines.append(
                    f"  lr {s['lr']:g}: {name:<10} val loss {x['final_val_loss']:.4f}, worst "
                    f"spike {x['max_loss_spike']:.3f}{', diverged' if x['diverged'] else ''}"
                )
    a = result.get("admm")
    if a is not None:
        for model, r in a.items():
            if isinstance(r, dict) and "admm" in r:
                lines.append(
                    f"admm {model}: dense {r['dense']:.4f}, magnitude {r['magnitude']:.4f}, "
                    f"magnitude+finetune {r['magnitude_finetune']:.4f}, admm {r['admm']:.4f}"
                )
    r = result.get("random_ltd")
    if r is not None:
        med, v = r["step_s_median"], r["final_val_loss"]
        lines.append(
            f"random_ltd ({r['preset']}, layers {r['random_ltd_layers'][0]}-"
            f"{r['random_ltd_layers'][-1]} of {r['n_layer']}, {r['steps']} steps x "
            f"{r['micro_batch']}x{r['seq_len']} tokens)"
        )
        lines.append(
            f"  step {med['plain']:.3f} s -> {med['random_ltd']:.3f} s "
            f"({r['wall_clock_saved']:.1%} less wall-clock, {r['flops_saved']:.1%} fewer FLOPs)"
        )
        lines.append(
            f"  val loss {v['plain']:.4f} -> {v['random_ltd']:.4f} (gap {r['val_loss_gap']:+.2%}); "
            f"target >= 20% at gap <= 2%: {'met' if r['meets_target'] else 'not met'}"
        )
    lines += _scala_lines(result.get("scala"))
    return "\n".join(lines)


def _scala_lines(s: dict[str, Any] | None) -> list[str]:
    if s is None:
        return []
    st = s["settings"]
    lines = [
        f"scala ({s['task']}; MiniLM at batch {st['batch']}, baseline lr {st['lr']:g}, scala lr "
        f"{st['scala_lr']:g}, eps {st['adv_max_norm']:g} (a line's embedding norm "
        f"{s['line_embedding_norm']:.2f}), K {st['adv_steps']}, t0 {st['adv_start_step']}; "
        f"target accuracy {s['target']} = {s['target_from']}; {st['seeds']} seeds, "
        f"{st['max_steps']} steps; a missed target is None and counts as {st['max_steps'] + 1})"
    ]
    for name in ("baseline", "scala"):
        x, f = s[name]["steps_to_target"], s[name]["final_accuracy"]
        lines.append(
            f"  {name:<9} steps to target: median {x['median']} (min {x['min']}, max {x['max']}; "
            f"per seed {x['per_seed']}); final accuracy median {f['median']:.4f} "
            f"{f['per_seed']}; {s[name]['s_per_step']:.2f} s/step"
        )
    lines.append(
        f"  scala / baseline: {s['step_ratio']:.2f}x the steps, {s['s_per_step_ratio']:.2f}x "
        f"the time per step, {s['time_ratio']:.2f}x the training time to target; fewer steps: "
        f"{'yes' if s['fewer_steps'] else 'no'}"
    )
    return lines
