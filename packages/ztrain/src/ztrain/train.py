"""`z train`: the GPT of `gpt.py` (or with `--moe` the MoE LM of `moe_lm.py`) on Shakespeare under the zcore ZeRO engine, on every rank.

A run directory holds everything one run writes::

    metrics.jsonl            one record per step (rank 0); `bytes_intra`/`bytes_inter`:
                             what a rank sent in the step's collectives (mean over ranks)
    loss.png                 train and val loss against step
    checkpoints/<tag>/       the sharded engine checkpoint (`engine.save_checkpoint`)
    checkpoints/model.json   GPTConfig and tokenizer beside it, so the checkpoint alone
    checkpoints/tokenizer.json   can be consolidated and sampled
    export/                  consolidated fp32 weights + model.json + tokenizer.json

Batches are indexed by step (`TokenStream.get_micro_batch`), so `--resume` continues the
exact batch sequence. The default config is ZeRO stage 3, AdamW, WarmupCosineLR and
clipping 1.0; with `--config` the file's keys win and the flags fill in what it leaves out.

The options go down once: `train_plan.plan_run` turns them into a `TrainPlan`,
`trainer.Trainer.start` makes the ranks, data and engine from the plan, and `run` below
is the loop, which reads only the trainer (and its plan).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ztrain.train_plan import TrainPlan
from ztrain.trainer import Trainer


def _restart_metrics(path: Path, resume_step: int | None) -> None:
    """Start `metrics.jsonl` afresh, or keep the records up to `resume_step` (a resumed run
    rewrites the steps after its checkpoint, and measures that step's val loss again)."""
    from zcore.checkpoint.files import save_text
    from ztrain.metrics import read_jsonl

    kept = []
    if resume_step is not None and path.is_file():
        for record in read_jsonl(path):
            if record.get("step", 0) < resume_step:
                kept.append(record)
            elif record.get("step") == resume_step and "loss" in record:
                kept.append({k: v for k, v in record.items() if k != "val_loss"})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept), path)


def run(plan: TrainPlan, echo: Callable[[str], None] = print, report: bool = True) -> int:
    """Train on this rank (every rank of the job calls it); returns the exit code. Without
    `report` the run ends at its last checkpoint (no export, plot or summary: benchmarks)."""
    from zcore.process import rss_bytes
    from ztrain.metrics import JsonlWriter
    from ztrain.moe_plan import model_name
    from ztrain.progress import TrainProgress

    t = Trainer.start(plan)
    engine, ranks = t.engine, t.ranks
    first, b = engine.global_steps, engine.batch
    if t.rank0:
        _restart_metrics(plan.metrics, first if plan.resume else None)
        name = model_name(t.model_config, plan.preset)
        moe = f"; {plan.moe.describe()}" if plan.moe else ""
        lay = plan.layout
        layout = f" ({lay.describe(ranks.world)})" if lay.parallel else ""
        echo(
            f"training {name} ({t.model_config.num_params() / 1e6:.1f}M params{moe}) on "
            f"{ranks.world} rank(s){layout}, ZeRO stage {engine.stage}, {t.precision}: steps {first} -> "
            f"{plan.steps}, batch {b.world_size}x{b.micro_batch_size}x"
            f"{b.gradient_accumulation_steps} x {plan.seq_len} tokens"
        )
    writer = JsonlWriter(plan.metrics) if t.rank0 else None
    print_every = max(1, (plan.steps - first) // 20)
    t_start, train_time, window = time.perf_counter(), 0.0, [0, 0.0]
    tokens_start = t.tokens_seen
    with TrainProgress(plan.steps, enabled=t.rank0) as progress:
        val_loss = t.evaluate()
        progress.log(f"step {first}: val loss {val_loss:.4f}")
        if writer is not None:
            writer.write({"step": first, "val_loss": val_loss})
        for step in range(first, plan.steps):
            t0, lr = time.perf_counter(), engine.get_lr()[0]
            sent_before = engine.mesh.traffic()
            loss = t.train_step(step)
            sent = engine.mesh.traffic().minus(sent_before).total  # this step's, this rank's
            # [loss, rss, bytes intra, bytes inter, MoE stats...]
            mine = [loss, rss_bytes() / 2**20, sent.intra, sent.inter, *t.moe.vector()]
            gathered = ranks.gather(*mine)
            rows = [gathered[r * len(mine) : (r + 1) * len(mine)] for r in range(ranks.world)]
            dt = time.perf_counter() - t0
            train_time += dt
            window[0], window[1] = window[0] + t.last_tokens, window[1] + dt
            done, loss, rss = step + 1, sum(r[0] for r in rows) / ranks.world, [r[1] for r in rows]
            bytes_intra = round(sum(r[2] for r in rows) / ranks.world)
            bytes_inter = round(sum(r[3] for r in rows) / ranks.world)
            record: dict[str, Any] = {
                "step": done,
                "loss": loss,
                "lr": lr,
                "grad_norm": engine.get_global_grad_norm(),
                "tokens_per_s": t.last_tokens / dt,
                "tokens": t.tokens_seen,
                "rank_rss_mib": rss,
                "bytes_intra": bytes_intra,
                "bytes_inter": bytes_inter,
                **t.moe.record([r[4:] for r in rows]),
            }
            if t.curriculum.enabled:
                record["seqlen"] = t.curriculum.last_seqlen
            val = None
            if done % plan.eval_interval == 0 or done == plan.steps:
                val = record["val_loss"] = t.evaluate()
                progress.log(f"step {done}: val loss {val:.4f}")
            record["elapsed_s"] = time.perf_counter() - t_start
            if writer is not None:
                writer.write(record)
            if progress.live or val is not None or done % print_every == 0:
                tps = window[0] / window[1]
                progress.update(
                    step=done,
                    loss=loss,
                    tokens_per_s=tps,
                    rank_rss_mib=rss,
                    val_loss=val,
                    aux_loss=record.get("aux_loss"),
                    dropped_fraction=record.get("dropped_fraction"),
                    bytes_sent=(bytes_intra, bytes_inter),
                )
                window = [0, 0.0]
            if plan.save_every and done % plan.save_every == 0 and done < plan.steps:
                t.save()
    if writer is not None:
        writer.close()
    path = t.save()
    if t.rank0 and report:
        _report(t, t.tokens_seen - tokens_start, path, t_start, train_time, echo)
    t.close()
    return 0


def _report(
    t: Trainer,
    tokens: int,
    checkpoint: str,
    t_start: float,
    train_s: float,
    echo: Callable[[str], None],
) -> None:
    """Export the model, plot the loss curve and say where everything is (rank 0)."""
    from ztrain.metrics import plot_loss_curve, read_jsonl

    plan = t.plan
    export = t.export()
    from ztrain.moe_plan import model_name

    title = f"{model_name(t.model_config, plan.preset)} on Shakespeare"
    png = plot_loss_curve(plan.metrics, plan.out / "loss.png", title)
    vals = [(rec["step"], rec["val_loss"]) for rec in read_jsonl(plan.metrics) if "val_loss" in rec]
    first = plan.start
    tps = tokens / train_s if train_s else 0.0
    echo(
        f"done: steps {first} -> {plan.steps} in {time.perf_counter() - t_start:.0f} s, "
        f"{tps:,.0f} tokens/s over all ranks; val loss {vals[0][1]:.4f} (step {vals[0][0]}) "
        f"-> {vals[-1][1]:.4f} (step {vals[-1][0]})\n"
        f"  metrics     {plan.metrics}\n  loss curve  {png}\n  checkpoint  {checkpoint}\n"
        f"  export      {export}\n"
        f'next: `z generate --checkpoint {plan.out} --prompt "ROMEO:"`'
        + (f"; `z export-mixtral {plan.out} {plan.out / 'mixtral'}`" if plan.moe else "")
    )
