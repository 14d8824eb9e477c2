"""`z train`'s side of curriculum learning: its samples, their index files, and the batches.

With DeepSpeed's legacy `curriculum_learning` (`curriculum_type: seqlen`) every batch is cut
to the step's difficulty (the model is trained on the first `seqlen` tokens of each window;
validation stays at `--seq-len`). With `data_efficiency`'s curriculum sampler, a sample is
one of the split's non-overlapping windows of `--seq-len + 1` tokens (sample `i` starts at
token `i * seq_len`); each step's global batch of sample ids comes from the sampler and each
rank keeps its slice as with the random windows. Index files the config names but that do
not exist are written by rank 0 for the metrics z train knows (`seqlen`, `vocab_rarity`):
the data analyzer runs once, later runs read the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ztrain.train_options import TrainError

KNOWN_METRICS = ("seqlen", "vocab_rarity")


def _metric_values(name: str, samples: np.ndarray, vocab_size: int) -> torch.Tensor:
    from zcore.data_efficiency import seqlen, vocab_rarity

    tokens = torch.from_numpy(samples.astype(np.int64))
    return seqlen(tokens) if name == "seqlen" else vocab_rarity(tokens, vocab_size)


def write_missing_indexes(config: Any, samples: np.ndarray, vocab_size: int) -> list[str]:
    """Analyze `samples` (N, T) for each sampler metric whose index files are missing (rank
    0, before the others read them); returns one line per metric analyzed."""
    from zcore.data_efficiency.analyzer import save_index
    from zcore.data_efficiency.config import parse_blocks

    de, _ = parse_blocks(config)
    if de.curriculum is None:
        return []
    lines = []
    where = "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics"
    for name, m in de.curriculum.curriculum_metrics.items():
        if m.clustering_type != "schedule_based":
            continue
        assert m.index_to_sample_path is not None
        metric_path = m.index_to_metric_path or m.index_to_sample_path.replace(
            "index_to_sample", "index_to_metric"
        )
        if Path(m.index_to_sample_path).is_file() and Path(metric_path).is_file():
            continue
        if name not in KNOWN_METRICS:
            raise TrainError(
                f"{where}.{name}: `{m.index_to_sample_path}` does not exist and z train "
                f"analyzes only {', '.join(KNOWN_METRICS)}; write its index with "
                "`zcore.data_efficiency.analyze` or rename the metric"
            )
        values = _metric_values(name, samples, vocab_size)
        save_index(values, m.index_to_sample_path, metric_path)
        lines.append(f"analyzed {len(samples)} samples by {name} -> {m.index_to_sample_path}")
    return lines


class CurriculumBatches:
    """One run's curriculum: which windows each step trains on, and how long they are."""

    def __init__(self, curriculum: Any, full_seq_len: int, global_batch: int) -> None:
        self.curriculum = curriculum
        self.full = full_seq_len
        self.global_batch = global_batch
        self.last_seqlen = full_seq_len
        self._ids: torch.Tensor | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.curriculum.enabled)

    def begin_step(self, step: int) -> int:
        """Advance to optimizer step `step` (0-based, called once per step in order);
        returns its tokens per sample."""
        self.last_seqlen = self.curriculum.seqlen(step, self.full)
        if self.curriculum.sampler is not None:
            self._ids = self.curriculum.sampler.next_batch()
        return self.last_seqlen

    def micro_batch(
        self, stream: Any, step: int, micro: int, rank: int, batch: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of `rank`'s micro-batch `micro`, cut to the step's sequence length."""
        from zcore.data_efficiency import truncate

        mb, accum = batch.micro_batch_size, batch.gradient_accumulation_steps
        if self._ids is None:
            x, y = stream.get_micro_batch(step, micro, rank, batch.world_size, mb, accum)
        else:
            start = (rank * accum + micro) * mb
            x, y = stream.sample_windows(self._ids[start : start + mb].numpy())
        x, y = truncate(self.last_seqlen, x, y)
        return x, y

    def tokens_before(self, step: int) -> int:
        """Tokens trained on in steps `0 .. step - 1` (the schedule's values)."""
        sched = self.curriculum.seqlen_schedule
        if sched is None:
            return step * self.global_batch * self.full
        per = [min(self.full, int(sched.difficulty_at(s + 1))) for s in range(step)]
        return self.global_batch * sum(per)

    def state_dict(self) -> dict[str, Any]:
        return self.curriculum.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not self.enabled:
            return
        try:
            self.curriculum.load_state_dict(state or {})
        except ValueError as error:
            raise TrainError(str(error)) from None
