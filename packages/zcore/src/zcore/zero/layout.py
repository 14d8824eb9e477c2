"""How parameters are split across data-parallel ranks — one layout for every ZeRO stage.

Each parameter is flattened and cut into ``world`` equal slots of
``shard_size = ceil(numel / world)`` elements (the last slot zero-padded). Rank ``r``
owns slot ``r`` of every parameter; its flat buffers (fp32 master weights, optimizer
state, gradient partition) are the concatenation of its slots, parameter after
parameter, in a fixed order. Stage 0 is the same layout with ``world = 1``.

Because every rank's buffer is described by the same small table, a checkpoint written
on one world size can be re-cut for another by intersecting element ranges, and a
reduce-scatter over a bucket of parameters lands exactly on each rank's slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamShard:
    """One parameter's place in every rank's flat buffer.

    Rank ``r`` holds elements ``[r * shard_size, (r + 1) * shard_size)`` of the flattened
    parameter (zero past ``numel``) at ``[offset, offset + shard_size)`` of its buffer.
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    shard_size: int
    offset: int

    def owned(self, rank: int) -> tuple[int, int]:
        """The element range ``[start, end)`` of the parameter that ``rank`` holds (maybe empty)."""
        start = min(rank * self.shard_size, self.numel)
        return start, min(start + self.shard_size, self.numel)


@dataclass(frozen=True)
class GroupLayout:
    """The layout of one optimizer parameter group."""

    shards: tuple[ParamShard, ...]
    world: int

    @property
    def numel(self) -> int:
        """Elements in each rank's flat buffer for this group (padding included)."""
        return sum(s.shard_size for s in self.shards)

    @classmethod
    def build(cls, named: Sequence[tuple[str, tuple[int, ...]]], world: int) -> GroupLayout:
        shards, offset = [], 0
        for name, shape in named:
            numel = 1
            for d in shape:
                numel *= d
            size = -(-numel // world)
            shards.append(ParamShard(name, tuple(shape), numel, size, offset))
            offset += size
        return cls(tuple(shards), world)

    def to_json(self) -> dict:
        return {
            "world": self.world,
            "shards": [
                {
                    "name": s.name,
                    "shape": list(s.shape),
                    "numel": s.numel,
                    "shard_size": s.shard_size,
                    "offset": s.offset,
                }
                for s in self.shards
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> GroupLayout:
        shards = tuple(
            ParamShard(d["name"], tuple(d["shape"]), d["numel"], d["shard_size"], d["offset"])
            for d in data["shards"]
        )
        return cls(shards, int(data["world"]))


def slot_view(full_flat: torch.Tensor, shard: ParamShard, world: int) -> torch.Tensor:
    """``full_flat`` (``numel`` elements) padded to ``(world, shard_size)``; a view when no pad."""
    pad = world * shard.shard_size - shard.numel
    if pad:
        full_flat = torch.nn.functional.pad(full_flat, (0, pad))
    return full_flat.view(world, shard.shard_size)


def own_slot(full: torch.Tensor, shard: ParamShard, rank: int) -> torch.Tensor:
    """This rank's slot of a full parameter, zero-padded to ``shard_size`` (a copy)."""
    flat = full.reshape(-1)
    start, end = shard.owned(rank)
    out = torch.zeros(shard.shard_size, dtype=full.dtype, device=full.device)
    out[: end - start].copy_(flat[start:end])
    return out


def from_slots(grid: torch.Tensor, col: int, shard: ParamShard) -> torch.Tensor:
    """A parameter's full flat value from an all-gather result.

    ``grid`` is ``(world, cols)``: row ``r`` is rank ``r``'s input, in which the
    parameter's slot occupies columns ``[col, col + shard_size)``. A view when the
    parameter is the whole grid, a copy otherwise.
    """
    return grid[:, col : col + shard.shard_size].reshape(-1)[: shard.numel]


def copy_ranges(
    dst: torch.Tensor,
    dst_layout: GroupLayout,
    dst_rank: int,
    src: torch.Tensor,
    src_layout: GroupLayout,
    src_rank: int,
) -> int:
    """Copy into ``dst`` (a rank buffer of ``dst_layout``) every element it shares with ``src``.

    Parameters are matched by name and must have the same shape in both layouts (else
    ``ValueError``: the flat ranges of another shape hold other elements); returns how many
    elements were copied. Used to re-cut checkpoints for another world size.
    """
    by_name = {s.name: s for s in src_layout.shards}
    copied = 0
    for d in dst_layout.shards:
        s = by_name.get(d.name)
        if s is None:
            continue
        if s.shape != d.shape:
            raise ValueError(
                f"parameter `{d.name}` has shape {s.shape} in the source layout and {d.shape} "
                "in the destination; only a parameter of the same shape can be re-cut"
            )
        d0, d1 = d.owned(dst_rank)
        s0, s1 = s.owned(src_rank)
        lo, hi = max(d0, s0), min(d1, s1)
        if lo >= hi:
            continue
        dst[d.offset + lo - d0 : d.offset + hi - d0].copy_(
            src[s.offset + lo - s0 : s.offset + hi - s0]
        )
        copied += hi - lo
    return copied
