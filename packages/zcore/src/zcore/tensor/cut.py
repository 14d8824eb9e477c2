"""How a tensor-parallel parameter is cut: which dimension, in which blocks, over how many ranks.

A cut parameter holds its local shard as a plain tensor (never a DTensor), so ZeRO's flat
buffers take it unchanged; it is tagged ``zero_axis = "tp"`` (:mod:`zcore.zero.axes`: a group
of its own, its gradient norm summed across ``tp``) and carries a :class:`TPCut` saying how
its shards make the full tensor. A fused weight is cut by blocks: ``blocks=(q, k, v)`` cuts
each of the three row blocks into ``tp`` equal slices and rank ``r`` holds the ``r``-th slice
of every block, in block order (so each rank's q, k and v hold the same heads).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zcore.zero.axes import ATTR

CUT_ATTR = "_z_tp"
"""The parameter attribute holding its :class:`TPCut` (absent: not cut by ``tp``)."""


@dataclass(frozen=True)
class TPCut:
    """A tensor cut along ``dim`` into ``tp`` shards; ``blocks`` are the full sizes along
    ``dim`` of the blocks each shard takes an equal slice of (one block: a plain cut)."""

    dim: int
    blocks: tuple[int, ...]
    tp: int

    def local(self, block: int) -> int:
        return self.blocks[block] // self.tp

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``full`` (a copy)."""
        pieces = full.split(list(self.blocks), dim=self.dim)
        mine = [
            p.narrow(self.dim, rank * self.local(i), self.local(i)) for i, p in enumerate(pieces)
        ]
        return torch.cat(mine, dim=self.dim).clone()

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in ``tp`` order."""
        per_rank = [
            s.split([self.local(i) for i in range(len(self.blocks))], self.dim) for s in shards
        ]
        blocks = [
            torch.cat([r[i] for r in per_rank], dim=self.dim) for i in range(len(self.blocks))
        ]
        return torch.cat(blocks, dim=self.dim)


def check_blocks(what: str, dim_name: str, blocks: Sequence[int], tp: int) -> None:
    """Every block divisible by ``tp``, else a ValueError naming the sizes and the fix."""
    bad = [b for b in blocks if b % tp]
    if bad:
        raise ValueError(
            f"{what}: {dim_name} {list(blocks)} is not divisible by tp {tp} "
            f"({bad[0]} % {tp} = {bad[0] % tp}); choose a tp that divides {bad[0]}"
        )


def mark(p: nn.Parameter, cut: TPCut) -> nn.Parameter:
    """Tag ``p`` as a tensor-parallel shard cut as ``cut``."""
    setattr(p, ATTR, "tp")
    setattr(p, CUT_ATTR, cut)
    return p


def cut_by_tp(p: torch.Tensor) -> TPCut | None:
    """How ``p`` is cut across ``tp`` (None: every ``tp`` rank holds all of it)."""
    return getattr(p, CUT_ATTR, None)


def cuts_json(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """``{name: {"dim", "blocks", "tp"}}`` of the parameters cut by ``tp`` (a checkpoint
    manifest's ``"tp_cuts"``, from which ``consolidate`` reassembles them)."""
    out = {}
    for name, p in named:
        cut = cut_by_tp(p)
        if cut is not None:
            out[name] = {"dim": cut.dim, "blocks": list(cut.blocks), "tp": cut.tp}
    return out


def cut_from_json(info: dict[str, Any]) -> TPCut:
    return TPCut(int(info["dim"]), tuple(int(b) for b in info["blocks"]), int(info["tp"]))
