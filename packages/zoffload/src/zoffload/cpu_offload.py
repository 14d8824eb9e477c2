"""ZeRO-Offload (``offload_optimizer.device = "cpu"``): each rank's fp32 master partition,
optimizer state and gradient partition live in host memory and the step runs there with
zcore's native CPU optimizers.

The gradient of each bucket is copied out of the device as its reduction completes (while
backward goes on), and the updated weights travel back in the all-gather (stages 1-2) or
into the stage-3 shards. Host tensors are page-locked when ``pin_memory`` is set and a
GPU is present. On a CPU-only machine the model is already in host memory, so the step
is zcore's own with the master kept on the CPU.
"""

from __future__ import annotations

import torch

from zcore.config import ZConfig
from zcore.zero.store import MemoryStore, OptimizerStore


def cpu_optimizer(config: ZConfig) -> OptimizerStore:
    """The :mod:`zcore.zero.backends` store for ``device = "cpu"``: zcore's in-memory store,
    kept in (pinned) host memory."""
    offload = config.zero_optimization.offload_optimizer
    pin = bool(offload.pin_memory) if offload is not None else False
    return MemoryStore(torch.device("cpu"), pin_memory=pin)
