"""Optimizers whose step runs in zstack's native core.

:class:`CPUAdam`, :class:`CPUAdamW`, :class:`CPUAdagrad` and :class:`CPULion`
are ``torch.optim.Optimizer`` subclasses for fp32 CPU parameters. They update
parameters in place with no copy, multi-threaded and SIMD-vectorized, and
their ``state_dict()`` has the same keys and shapes as ``torch.optim.Adam``'s
(resp. ``Adagrad``), so checkpoints move between them. Optimizer states may be
kept in bfloat16 (``state_dtype=torch.bfloat16``) to halve their memory and
traffic. :mod:`zcore.optim.functional` runs one step on explicit tensors and
also takes bfloat16 gradients.
"""

from zcore.optim._base import NativeOptimizer
from zcore.optim.cpu_adagrad import CPUAdagrad
from zcore.optim.cpu_adam import CPUAdam, CPUAdamW
from zcore.optim.cpu_lion import CPULion
from zcore.optim.fused_adam_cuda import FusedAdamCUDA

__all__ = ["CPUAdagrad", "CPUAdam", "CPUAdamW", "CPULion", "FusedAdamCUDA", "NativeOptimizer"]
