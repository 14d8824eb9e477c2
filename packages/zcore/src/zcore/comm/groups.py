"""Joining the job's process group, and the backend zcore asks for (groups: :mod:`.mesh`)."""

from __future__ import annotations

import os
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
