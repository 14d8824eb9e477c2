"""Process groups, built once per job."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(timeout_s: float, backend: str | None = None) -> bool:
    """Join the job's process group if the launcher set one up; return whether one exists.

    Under `torchrun` / `z launch` (``RANK`` and ``WORLD_SIZE`` in the environment) this
    calls ``init_process_group`` with gloo on CPU or NCCL when CUDA is present. A plain
    ``python train.py`` runs as a single rank with no process group.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return True


@dataclass
class ProcessGroups:
    """The groups a job communicates over.

    ``dp`` is the data-parallel group that ZeRO partitions across (``None`` means a single
    process without ``torch.distributed``). Later packages add groups here (expert-parallel
    in zmoe, hierarchical/secondary partitions in zcomm) under ``extra`` rather than
    building their own, so every group is created exactly once, in the same order on every
    rank.
    """

    dp: dist.ProcessGroup | None
    dp_rank: int
    dp_size: int
    extra: dict[str, dist.ProcessGroup] = field(default_factory=dict)

    @classmethod
    def build(cls, timeout_s: float, device: torch.device | None = None) -> ProcessGroups:
        """Data-parallel over the whole world (or a single process).

        A group created here uses NCCL for a model on a CUDA device and gloo otherwise.
        """
        backend = None if device is None else "nccl" if device.type == "cuda" else "gloo"
        if not init_distributed(timeout_s, backend):
            return cls(dp=None, dp_rank=0, dp_size=1)
        group = dist.group.WORLD
        return cls(dp=group, dp_rank=dist.get_rank(group), dp_size=dist.get_world_size(group))
