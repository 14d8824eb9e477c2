"""hpZ: a node-local secondary copy of every stage-3 parameter for the backward gathers.

ZeRO-3 gathers each parameter twice per step, before its module's forward and again
before its backward, each time from all ``W`` ranks of the ZeRO axis, i.e. across nodes.
hpZ (``zero_hpz_partition_size = L``) keeps, after every forward gather, this rank's
``1 / L`` slice of the full parameter cut across its group of ``L`` node-local ranks (the
mesh's ``dp_local`` axis). The backward gather then reads those slices over ``dp_local``:
every byte of it stays inside the node. The price is memory: ``numel / L`` elements per
parameter per rank besides the primary ``numel / W`` shard.

The secondary copy is re-cut from every forward gather (and from every edit of a
parameter through ``GatheredParameters``), so after the optimizer's step the next forward
refreshes it before any backward reads it. A parameter that has none yet (no forward
since the engine started) is gathered the ordinary way. With qwZ on, the secondary slices
are cut from the dequantized forward weights and their gather is quantized too.
"""

from __future__ import annotations

import torch
from torch import nn

from zcore.comm import Comm
from zcore.zero.layout import ParamShard, own_slot


class SecondaryPartition:
    """The secondary slices of the parameters sharded over ``primary`` (the ZeRO axis).

    Args:
        primary: the ZeRO axis's comm; parameters cut across another axis (experts) are
            left alone.
        local: the node-local sub-axis ``dp_local`` the secondary copy is cut across.
    """

    def __init__(self, primary: Comm, local: Comm) -> None:
        self.primary = primary
        self.local = local
        self._pieces: dict[nn.Parameter, torch.Tensor] = {}

    def source(
        self, p: nn.Parameter, comm: Comm, backward: bool
    ) -> tuple[Comm, torch.Tensor] | None:
        """``(dp_local, this rank's secondary slice)`` for a backward gather of ``p``."""
        if not backward or comm is not self.primary:
            return None
        piece = self._pieces.get(p)
        return None if piece is None else (self.local, piece)

    def keep(self, p: nn.Parameter, comm: Comm, full: torch.Tensor) -> None:
        """Cut this rank's secondary slice from ``p``'s full value ``full``."""
        if comm is not self.primary:
            return
        numel = full.numel()
        size = -(-numel // self.local.size)
        slots = ParamShard("", tuple(full.shape), numel, size, 0)
        self._pieces[p] = own_slot(full.detach(), slots, self.local.rank)

    def held_elems(self) -> int:
        """Elements of secondary slices this rank holds (its memory cost)."""
        return sum(t.numel() for t in self._pieces.values())
