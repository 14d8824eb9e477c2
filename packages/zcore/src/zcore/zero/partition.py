"""What a state store sees of the optimizer: the hand-off object between the two.

:class:`~zcore.zero.optimizer.ZeroOptimizer` decides the layout of each rank's slots and
hands a store (:mod:`zcore.zero.store`) one :class:`Partition`; the store learns nothing
else about the optimizer (no reducers, no collectives, no clipping), so either side can
change alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from zcore.comm import Comm
from zcore.zero.layout import GroupLayout, ParamShard

if TYPE_CHECKING:
    from zcore.zero.stage3 import Stage3Params


@dataclass(frozen=True)
class Partition:
    """This rank's partition of every parameter group, as a store needs it."""

    params: list[list[nn.Parameter]]
    """Each group's parameters, in layout order."""
    layouts: list[GroupLayout]
    """Each group's cut into slots (the store's flat tensors are ``layouts[g].numel`` long)."""
    where: dict[nn.Parameter, tuple[int, ParamShard]]
    """Parameter -> (group, its shard description in that group's layout)."""
    stage: int
    """The ZeRO stage (0-1: gradient partitions exist per cycle; 2-3: they are kept)."""
    grad_accum_dtype: torch.dtype
    """The dtype gradient partitions accumulate in."""
    comm: Comm
    """The ``dp`` collectives: a store may vote on failures over it; ``comm.rank`` names files."""
    slot_of: Callable[[nn.Parameter], torch.Tensor]
    """This rank's slot of a parameter as fp32 (from its stage-3 shard or its full value)."""
    stage3: Stage3Params | None = None
    """Stage 3's shards, which a store that steps in place writes the new weights into."""
