"""Process groups, built once per job."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

#: The backend of a group zcore creates for a CUDA model: NCCL for CUDA tensors and gloo
#: for CPU ones. :class:`~zcore.comm.Comm` reduces its scalars (gradient norm, overflow and
#: failure flags, barriers) as CPU tensors, which a pure ``"nccl"`` group rejects with
#: "No backend type associated with device type cpu".
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


def backend_for(device: torch.device | str) -> str:
    """The backend of a process group zcore creates for a model on ``device``."""
    return CUDA_BACKEND if torch.device(device).type == "cuda" else "gloo"


def init_distributed(timeout_s: float, backend: str | None = None) -> bool:
    """Join the job's process group if the launcher set one up; return whether one exists.

    Under `torchrun` / `z launch` (``RANK`` and ``WORLD_SIZE`` in the environment) this
    calls ``init_process_group`` with gloo on CPU or, when CUDA is present, NCCL for CUDA
    tensors plus gloo for CPU tensors (:data:`CUDA_BACKEND`). A plain ``python train.py``
    runs as a single rank with no process group.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    if backend is None:
        backend = backend_for("cuda" if torch.cuda.is_available() else "cpu")
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

        A group created here uses :data:`CUDA_BACKEND` for a model on a CUDA device and gloo
        otherwise. A group the script initialized itself is used as it is (a pure ``"nccl"``
        one fails zcore's first scalar collective with an error that names this fix).
        """
        backend = None if device is None else backend_for(device)
        if not init_distributed(timeout_s, backend):
            return cls(dp=None, dp_rank=0, dp_size=1)
        group = dist.group.WORLD
        return cls(dp=group, dp_rank=dist.get_rank(group), dp_size=dist.get_world_size(group))
