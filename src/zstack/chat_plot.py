"""The PNG of a `z chat` stage, drawn from its metrics JSONL (zchat's `Recorder` writes it).

:func:`plot_chat_metrics` (SFT, reward, DPO). Left: the training loss against step. Right: the stage's accuracy-like numbers against
step: the batch accuracy where the stage logs one (`acc`, `implicit_acc`) and the held-out
metrics recorded before (step 0) and after training (`heldout_*`, as points joined by a line).
:func:`plot_ppo_metrics`: rollout reward and KL against step, and the held-out evaluations.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ztrain.metrics import read_jsonl

_TRAIN_KEYS = ("acc", "implicit_acc")


def plot_chat_metrics(metrics: str | os.PathLike[str], png: str | os.PathLike[str]) -> Path:
    """Draw `png` from the JSONL `metrics`; returns its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_jsonl(metrics)
    stage = next((r.get("stage") for r in records), "chat")
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    loss_ax, metric_ax = fig.subplots(1, 2)
    steps = [r for r in records if "loss" in r]
    loss_ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], marker=".")
    loss_ax.set(title=f"{stage}: training loss", xlabel="step", ylabel="loss")
    for key in _TRAIN_KEYS:
        rows = [r for r in steps if key in r]
        if rows:
            metric_ax.plot(
                [r["step"] for r in rows], [r[key] for r in rows], label=f"train {key}", alpha=0.6
            )
    held = sorted({k for r in records for k in r if k.startswith("heldout_")})
    for key in held:
        rows = [r for r in records if key in r]
        metric_ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o", label=key)
    metric_ax.set(title=f"{stage}: metrics", xlabel="step")
    if metric_ax.get_legend_handles_labels()[0]:
        metric_ax.legend(fontsize="small")
    return _save(fig, png)


def _save(fig: Any, png: str | os.PathLike[str]) -> Path:
    fig.tight_layout()
    out = Path(png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(out), dpi=100)
    return out


def plot_ppo_metrics(metrics: Path, png: Path) -> Path:
    """PPO's PNG: reward and KL against step (left), the held-out reward and exact match
    before, during and after (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_jsonl(metrics)
    steps = [r for r in records if "reward" in r and "eval" not in r]
    held = [r for r in records if "eval" in r]
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    x = [r["step"] for r in steps]
    left.plot(x, [r["reward"] for r in steps], marker=".", label="rollout reward")
    kl_ax = left.twinx()
    kl_ax.plot(x, [r["kl"] for r in steps], marker=".", color="tab:red", label="KL to reference")
    left.set(title="ppo: reward and KL", xlabel="step", ylabel="reward")
    kl_ax.set(ylabel="KL (per token)")
    for key in (
        "heldout_reward",
        "heldout_accuracy",
        "heldout_sampled_reward",
        "heldout_sampled_accuracy",
    ):
        if all(key in r for r in held):
            right.plot([r["step"] for r in held], [r[key] for r in held], marker="o", label=key)
    right.set(title="ppo: held-out (greedy; sampled with heldout_samples)", xlabel="step")
    right.legend(fontsize="small")
    return _save(fig, png)
