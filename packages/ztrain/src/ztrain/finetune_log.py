"""`z finetune`'s progress line and `metrics.jsonl`, as a transformers Trainer callback.

The same record keys and progress line as `z train` (`ztrain.metrics`, `ztrain.progress`):
one record per optimizer step on rank 0 with `step`, `loss` (the step's mean over every rank
and micro-step, as the Trainer logs it), `lr`, `grad_norm`, `tokens` (non-padding tokens seen
by all ranks), `tokens_per_s`, `rank_rss_mib` (each rank's resident memory) and `elapsed_s`.
Each rank's memory is gathered at every step's end, a collective the loop reaches on every rank.
An evaluation adds a record with `step` and `eval_loss` (and the progress line shows it). A
fresh run starts `metrics.jsonl` anew; a resumed one keeps the records up to the step it
resumes after (`keep_through`) and appends.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from zcore.process import rss_bytes
from ztrain.metrics import JsonlWriter
from ztrain.progress import TrainProgress


def gather_rss_mib() -> list[float]:
    """Every rank's resident memory in MiB, in rank order (collective when distributed)."""
    mine = torch.tensor([rss_bytes() / 2**20], dtype=torch.float64)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [float(mine)]
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [float(t) for t in out]


class FinetuneLog(TrainerCallback):
    """Writes `metrics` (JSON Lines) and shows the progress line; both on rank 0 only."""

    def __init__(self, metrics: Path, *, rank0: bool, keep_through: int = 0) -> None:
        self.metrics = metrics
        self.rank0 = rank0
        self.keep_through = keep_through
        self._writer: JsonlWriter | None = None
        self._progress: TrainProgress | None = None
        self._start = self._step_start = 0.0
        self._step_s = 0.0
        self._tokens_at_log = 0
        self._rss: list[float] = []
        self.last_loss: float | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._start = time.perf_counter()
        self._tokens_at_log = int(state.num_input_tokens_seen)
        if self.rank0:
            self._keep_earlier_records()
            self._writer = JsonlWriter(self.metrics)
            self._progress = TrainProgress(state.max_steps, description="finetune").__enter__()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._step_start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._step_s += time.perf_counter() - self._step_start
        self._rss = gather_rss_mib()

    def _keep_earlier_records(self) -> None:
        """Leave in `metrics` only the records of steps up to `keep_through` (none when 0)."""
        kept: list[str] = []
        if self.keep_through and self.metrics.is_file():
            lines = self.metrics.read_text().splitlines()
            kept = [ln for ln in lines if ln and json.loads(ln)["step"] <= self.keep_through]
        self.metrics.parent.mkdir(parents=True, exist_ok=True)
        self.metrics.write_text("".join(line + "\n" for line in kept))

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        if logs and "eval_loss" in logs:
            self._eval(state.global_step, float(logs["eval_loss"]))
        if not logs or "loss" not in logs:
            return
        tokens = int(state.num_input_tokens_seen)
        seen, self._tokens_at_log = tokens - self._tokens_at_log, tokens
        tps = seen / self._step_s if self._step_s > 0 else None
        self._step_s = 0.0
        self.last_loss = float(logs["loss"])
        if self._writer is None or self._progress is None:
            return
        record = {
            "step": state.global_step,
            "loss": self.last_loss,
            "lr": logs.get("learning_rate"),
            "grad_norm": logs.get("grad_norm"),
            "tokens": tokens,
            "tokens_per_s": tps,
            "rank_rss_mib": self._rss,
            "elapsed_s": time.perf_counter() - self._start,
        }
        self._writer.write(record)
        self._progress.update(
            step=state.global_step,
            loss=self.last_loss,
            tokens_per_s=tps,
            rank_rss_mib=self._rss,
        )

    def _eval(self, step: int, loss: float) -> None:
        if self._writer is not None:
            self._writer.write({"step": step, "eval_loss": loss})
        if self._progress is not None:
            self._progress.update(step=step, val_loss=loss)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        """End the progress line; the metrics file stays open for a last evaluation."""
        self._end_progress()

    def _end_progress(self) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)
            self._progress = None

    def close(self) -> None:
        """End the progress line and close the metrics file (also after a failed run)."""
        self._end_progress()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
