"""What a training loop takes from a config's curriculum: the legacy sequence-length
schedule, the metric-driven sampler, and one ``state_dict`` for the checkpoint.

DeepSpeed's engine updates the legacy schedule with ``global_steps + 1`` before each
forward and hands the model ``curriculum_seqlen``; zcore's engine stays out of the data
path, so the loop asks :meth:`Curriculum.seqlen` for the step and truncates its batch
with :func:`truncate` (the same thing: the model sees the first ``seqlen`` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zcore.data_efficiency.analyzer import MetricIndex
from zcore.data_efficiency.config import parse_blocks
from zcore.data_efficiency.sampler import CurriculumSampler
from zcore.data_efficiency.schedules import CurriculumScheduler


def truncate(seqlen: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (B, T, ...) tensor cut to its first ``seqlen`` positions (T when shorter)."""
    return tuple(t[:, :seqlen] for t in tensors)


@dataclass
class Curriculum:
    """The curriculum parts a config turns on; either may be None."""

    seqlen_schedule: CurriculumScheduler | None
    """The legacy ``curriculum_learning`` (``curriculum_type: seqlen``) schedule."""
    sampler: CurriculumSampler | None
    """The ``data_efficiency`` curriculum sampler."""

    @classmethod
    def from_config(
        cls,
        config: Any,
        num_samples: int,
        global_batch_size: int,
        indexes: dict[str, MetricIndex] | None = None,
    ) -> Curriculum:
        """From a loaded ``ZConfig``; the sampler (when enabled) over ``num_samples``
        samples, its index files read from the config's paths unless ``indexes`` is given."""
        de, legacy = parse_blocks(config)
        schedule = CurriculumScheduler(legacy, "seqlen") if legacy.enabled else None
        sampler = None
        if de.curriculum is not None:
            sampler = CurriculumSampler(de, num_samples, global_batch_size, indexes)
        return cls(schedule, sampler)

    @property
    def enabled(self) -> bool:
        return self.seqlen_schedule is not None or self.sampler is not None

    def seqlen(self, step: int, full: int) -> int:
        """Tokens per sample at optimizer step ``step`` (0-based, as ``global_steps``):
        the legacy schedule's difficulty at ``step + 1``, at most ``full``."""
        if self.seqlen_schedule is None:
            return full
        return min(full, int(self.seqlen_schedule.update(step + 1)))

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.seqlen_schedule is not None:
            out["seqlen"] = self.seqlen_schedule.state_dict()
        if self.sampler is not None:
            out["sampler"] = self.sampler.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state_dict`; a part this run has that the checkpoint lacks is an
        error (the run would restart that part's stream)."""
        for key, part in (("seqlen", self.seqlen_schedule), ("sampler", self.sampler)):
            if part is None:
                continue
            if key not in state:
                raise ValueError(
                    f"the checkpoint has no curriculum {key} state, but this run's config "
                    "enables it; resume with the config the run started with"
                )
            part.load_state_dict(state[key])
