"""Training metrics as JSON Lines, and the loss-curve PNG drawn from them.

Record keys the plot reads: `step` (int), `loss` (train loss, float) and
`val_loss` (float); a record may carry either loss or both, and any other keys
(`tokens_per_s`, `lr`, `rank_rss_mib`, ...) are kept but not plotted.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import TracebackType
from typing import Any

from zcore.checkpoint import atomic_write


class JsonlWriter:
    """Appends one JSON object per line; each write is flushed, close also fsyncs."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record; a torn last line (a run killed mid-write) is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _points(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [
        (int(r["step"]), float(r[key]))
        for r in records
        if "step" in r and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]
    return [s for s, _ in pairs], [v for _, v in pairs]


def plot_loss_curve(
    jsonl_path: str | os.PathLike[str],
    png_path: str | os.PathLike[str],
    title: str = "GPT on Shakespeare",
) -> Path:
    """Draw train loss (line) and val loss (points) against step; write the PNG atomically.

    Uses matplotlib's object API with the Agg canvas: no display, no pyplot state.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_jsonl(jsonl_path)
    fig = Figure(figsize=(7, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps, loss = _points(records, "loss")
    val_steps, val_loss = _points(records, "val_loss")
    if steps:
        ax.plot(steps, loss, color="tab:blue", linewidth=1.2, label="train loss")
    if val_steps:
        ax.plot(val_steps, val_loss, "o-", color="tab:orange", markersize=4, label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if steps or val_steps:
        ax.legend()
    fig.tight_layout()

    png = Path(png_path)
    atomic_write(png, lambda f: fig.savefig(f, format="png"))
    return png


def val_curves(runs: dict[str, str | os.PathLike[str]]) -> dict[str, tuple[list[int], list[float]]]:
    """label -> (steps, val losses) of each run's `metrics.jsonl`."""
    return {label: _points(read_jsonl(path), "val_loss") for label, path in runs.items()}


def write_val_csv(
    runs: dict[str, str | os.PathLike[str]], csv_path: str | os.PathLike[str]
) -> Path:
    """`step,<label>,...` rows of the runs' val losses (empty where a run has none)."""
    curves = val_curves(runs)
    steps = sorted({s for xs, _ in curves.values() for s in xs})
    by_step = {label: dict(zip(xs, ys, strict=True)) for label, (xs, ys) in curves.items()}
    lines = [",".join(["step", *curves])]
    for s in steps:
        cells = [f"{by_step[lb][s]:.6f}" if s in by_step[lb] else "" for lb in curves]
        lines.append(",".join([str(s), *cells]))
    path = Path(csv_path)
    atomic_write(path, lambda f: f.write(("\n".join(lines) + "\n").encode()))
    return path


def plot_val_curves(
    runs: dict[str, str | os.PathLike[str]], png_path: str | os.PathLike[str], title: str
) -> Path:
    """One PNG with the val-loss curve of each run (label -> its `metrics.jsonl`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, (steps, losses) in val_curves(runs).items():
        ax.plot(steps, losses, "o-", markersize=3, label=f"{label} (final {losses[-1]:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("val cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = Path(png_path)
    atomic_write(png, lambda f: fig.savefig(f, format="png"))
    return png
