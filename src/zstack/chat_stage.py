"""What `z chat sft | reward | dpo` share: the config from a JSON file and flags, the checks
before any rank starts, the ranks, the PNG and the summary.

A stage is its zchat config class, its `prepare` (checks that can fail before ranks start:
weights, chat template, empty splits, a reward model's tokenizer) and its rank function. The
Shakespeare task's plays are loaded here (zchat does not import zstack) and handed to the
ranks.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer


def default_model() -> Path:
    """SmolLM2-135M-Instruct where `make models` puts it (`$ZSTACK_MODELS` overrides the root)."""
    root = Path(os.environ.get("ZSTACK_MODELS", Path.home() / ".cache" / "zstack" / "models"))
    return root / "SmolLM2-135M-Instruct"


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def run_stage(
    name: str,
    defaults: dict[str, Any],
    cfg_cls: Any,
    prepare: Callable[..., Any],
    train: Callable[..., Any],
    config: Path | None,
    nproc: int,
    as_json: bool,
    **flags: Any,
) -> dict[str, Any]:
    """Load the config (`defaults` < the `config` JSON < the flags given), check, run `train`
    on `nproc` ranks, plot; print and return a summary."""
    from zchat.config import ChatConfigError, load_config
    from zchat.ranks import RankFailed, run_on_ranks
    from zstack.chat_plot import plot_chat_metrics

    flags = {k: (str(v) if isinstance(v, Path) else v) for k, v in flags.items()}
    try:
        data = dict(defaults)
        if config is not None:
            try:
                data.update(json.loads(config.read_text()))
            except (OSError, ValueError) as err:
                raise ChatConfigError(f"cannot read `{config}`: {err}") from None
        cfg = load_config(cfg_cls, data, **flags)
    except ChatConfigError as err:
        raise _fail(f"{err} (`z chat {name} --help` lists the flags)") from None
    plays: tuple[Any, Any] = (None, None)
    if cfg.task == "shakespeare":
        from ztrain.data import load_plays, split_plays

        plays = split_plays(load_plays())
    try:
        prepare(cfg, plays)
    except (ValueError, FileNotFoundError) as err:
        raise _fail(str(err)) from None
    start = time.perf_counter()
    try:
        results = run_on_ranks(train, nproc, (cfg, plays))
    except RankFailed as err:
        raise _fail(str(err)) from None
    r = results[0]
    png = plot_chat_metrics(r["metrics"], Path(r["metrics"]).with_suffix(".png"))
    summary = {
        "stage": name,
        "out": r["out"],
        "steps": cfg.steps,
        "ranks": nproc,
        # None: no training steps ran (a reward stage whose warm-up did all the training)
        "final_loss": r["losses"][-1] if r["losses"] else None,
        "heldout_before": r["heldout_before"],
        "heldout_after": r["heldout_after"],
        "metrics": r["metrics"],
        "plot": str(png),
        "wall_s": time.perf_counter() - start,
        "train_s": r["train_s"],
    }
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        loss = summary["final_loss"]
        shown = "no steps after the warm-up" if loss is None else f"loss {loss:.4g}"
        typer.echo(
            f"{name}: {shown}; held-out before "
            f"{_short(r['heldout_before'])}, after {_short(r['heldout_after'])}"
        )
        typer.echo(f"wrote `{r['out']}`, `{r['metrics']}`, `{png}`")
    return summary


def _short(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in metrics.items())


DEFAULT_MODEL = default_model()
"""`z chat sft`'s default `--model`."""
