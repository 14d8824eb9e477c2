"""zoffload: ZeRO-Offload and ZeRO-Infinity.

Moves model states off the accelerator, chosen by zcore config:

- ``offload_optimizer.device = "cpu"`` (ZeRO-Offload, :mod:`zoffload.cpu_offload`):
  fp32 master weights, optimizer state and gradient partitions in (pinned) host
  memory, stepped by zcore's native CPU optimizers;
- ``offload_optimizer.device = "nvme"`` (ZeRO-Infinity, :mod:`zoffload.nvme_optimizer`):
  master weights and optimizer state in swap files, stepped in ``sub_group_size`` tiles
  with read-ahead and write-behind through the native async-IO engine.

- ``offload_param.device = "cpu" | "nvme"`` (ZeRO stage 3, :mod:`zoffload.param_store`):
  parameter shards in host memory or a swap file, read ahead from stage 3's module trace.

zcore finds this package through the ``zcore.extensions`` entry point
(:mod:`zoffload.extension` registers the devices), so a config is all a user writes.

The async file-IO layer is :mod:`zoffload.aio`, re-exported here:
:class:`AioHandle` (async and sync reads and writes of CPU tensors at file
offsets over io_uring or a thread pool, O_DIRECT), :class:`AioConfig`
(DeepSpeed's ``aio`` block) and :func:`new_aligned_tensor` (4096-aligned,
best-effort page-locked host tensors).
"""

from zoffload import extension as _extension  # noqa: F401 - registers with zcore
from zoffload.aio import (
    AioConfig,
    AioError,
    AioHandle,
    AioRequest,
    AioShortReadError,
    new_aligned_tensor,
)

__version__ = "0.1.0"

__all__ = [
    "AioConfig",
    "AioError",
    "AioHandle",
    "AioRequest",
    "AioShortReadError",
    "__version__",
    "new_aligned_tensor",
]
