"""The live training progress line of `z train` (rich), plain lines when not on a terminal.

    with TrainProgress(total_steps, enabled=rank == 0) as p:
        for step in range(1, total_steps + 1):
            ...
            p.update(step=step, loss=loss, tokens_per_s=tps, rank_rss_mib=rss, val_loss=val)

On a TTY: one live bar with step/total, loss, val loss, tokens/s, each rank's
resident memory and ETA. Otherwise (CI logs, pipes) every `update` prints one
plain line. `enabled=False` (ranks other than 0) prints nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text


def format_metrics(
    loss: float | None,
    val_loss: float | None,
    tokens_per_s: float | None,
    rank_rss_mib: Sequence[float],
    aux_loss: float | None = None,
    dropped_fraction: float | None = None,
    bytes_sent: tuple[int, int] | None = None,
) -> str:
    """`loss 4.1234 · val 4.3012 · 3,210 tok/s · sent intra 5.2 inter 0 MiB · rss r0 512 MiB`
    (parts that are set); an MoE run adds `aux 1.0123 · dropped 2.1%` after the losses.
    `bytes_sent` is what a rank sent in the last step, (intra-node, inter-node)."""
    parts = []
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if val_loss is not None:
        parts.append(f"val {val_loss:.4f}")
    if aux_loss is not None:
        parts.append(f"aux {aux_loss:.4f}")
    if dropped_fraction is not None:
        parts.append(f"dropped {dropped_fraction:.1%}")
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} tok/s")
    if bytes_sent is not None and sum(bytes_sent):
        intra, inter = (b / 2**20 for b in bytes_sent)
        parts.append(f"sent intra {intra:,.3g} inter {inter:,.3g} MiB")
    if rank_rss_mib:
        ranks = " ".join(f"r{r} {mib:,.0f}" for r, mib in enumerate(rank_rss_mib))
        parts.append(f"rss {ranks} MiB")
    return " · ".join(parts)


def format_duration(seconds: float) -> str:
    """`1:02:03`, `2:03`; `-:--` when unknown."""
    if not seconds >= 0 or seconds == float("inf"):
        return "-:--"
    s = round(seconds)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class _MetricsColumn(ProgressColumn):
    """The task's `metrics` field, preformatted by `format_metrics`; one line, cut at the edge."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1))

    def render(self, task: Task) -> Text:
        return Text(str(task.fields.get("metrics", "")), style="cyan")


class TrainProgress:
    """Progress of a training run; `update` after each step (or every few)."""

    def __init__(
        self,
        total_steps: int,
        *,
        enabled: bool = True,
        file: TextIO | None = None,
        description: str = "train",
        force_terminal: bool | None = None,
    ) -> None:
        """`file` defaults to stdout; `force_terminal` overrides TTY detection."""
        self.total_steps = total_steps
        self.enabled = enabled
        self.description = description
        self._file = file
        self._console = Console(file=file, force_terminal=force_terminal) if enabled else None
        self.live = bool(self._console and self._console.is_terminal)
        self._progress: Progress | None = None
        self._task = None
        self._start = 0.0
        self._first_step: int | None = None
        self._val_loss: float | None = None

    def __enter__(self) -> TrainProgress:
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=16),
                MofNCompleteColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                _MetricsColumn(),
                console=self._console,
                transient=False,
                expand=True,  # the metrics column (ratio=1) takes the rest, cut at the edge
            )
            self._progress.start()
            self._task = self._progress.add_task(
                self.description, total=self.total_steps, metrics=""
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def update(
        self,
        *,
        step: int,
        loss: float | None = None,
        tokens_per_s: float | None = None,
        rank_rss_mib: Sequence[float] = (),
        val_loss: float | None = None,
        aux_loss: float | None = None,
        dropped_fraction: float | None = None,
        bytes_sent: tuple[int, int] | None = None,
    ) -> None:
        """Show the state after `step` completed steps; the last val loss stays shown.
        `bytes_sent`: what a rank sent in the step, (intra-node, inter-node) bytes."""
        if not self.enabled:
            return
        if val_loss is not None:
            self._val_loss = val_loss
        metrics = format_metrics(
            loss, self._val_loss, tokens_per_s, rank_rss_mib, aux_loss, dropped_fraction, bytes_sent
        )
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step, metrics=metrics)
            return
        print(
            f"{self.description} step {step}/{self.total_steps} · {metrics} · "
            f"eta {format_duration(self._eta(step))}",
            file=self._file or sys.stdout,
            flush=True,
        )

    def log(self, message: str) -> None:
        """A line of its own (an eval result, a sample) above the live bar."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self._file or sys.stdout, flush=True)

    def _eta(self, step: int) -> float:
        # The rate counts from the first update, so set-up time before it is not extrapolated.
        now = time.perf_counter()
        if self._first_step is None:
            self._first_step, self._start = step, now
            return float("nan")
        done = step - self._first_step
        if done <= 0:
            return float("nan")
        return (now - self._start) / done * max(self.total_steps - step, 0)
