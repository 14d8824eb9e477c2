"""DeepSpeed's 1-bit optimizers, maintained: ``OneBitAdam``, ``ZeroOneAdam``, ``OneBitLamb``.

Named in a config's ``optimizer.type`` they are found through zcore's optimizer registry
(this package's ``zcore.optimizers`` entry points); zcore hands them local gradients while
they compress (:mod:`zcore.zero.communicating`).
"""

from zcomm.optim.onebit_adam import OneBitAdam
from zcomm.optim.onebit_lamb import OneBitLamb
from zcomm.optim.zero_one_adam import ZeroOneAdam

__all__ = ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
