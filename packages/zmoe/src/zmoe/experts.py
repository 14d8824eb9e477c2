"""This rank's experts, named by their global index so checkpoints do not depend on ``ep``.

``Experts`` is an ``nn.ModuleDict`` keyed by ``str(global_index)``: at ``ep_size=2`` with 8
experts, rank 1 holds keys ``"4"`` .. ``"7"``, so a parameter is ``experts.5.0.weight``
whatever the expert-parallel size, and a checkpoint holds one entry per expert.

Every expert parameter carries ``zero_axis = "edp"``: the ZeRO engine shards and reduces it
over the expert-data-parallel ranks (those holding the same experts), not over ``dp``.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

#: The public attribute naming the mesh axis a parameter's ZeRO partition spans.
ZERO_AXIS_ATTR = "zero_axis"
EXPERT_AXIS = "edp"


def _output(out: Tensor | tuple[Tensor, ...]) -> Tensor:
    return out[0] if isinstance(out, tuple) else out  # (output, bias) experts, as DeepSpeed


class Experts(nn.ModuleDict):
    """Deep copies of ``expert`` for global experts ``first .. first + count - 1``."""

    def __init__(self, expert: nn.Module, first: int, count: int) -> None:
        super().__init__({str(first + i): copy.deepcopy(expert) for i in range(count)})
        self.first = first
        for p in self.parameters():
            setattr(p, ZERO_AXIS_ATTR, EXPERT_AXIS)

    def run_slices(self, x: Tensor, counts: list[int]) -> Tensor:
        """[sum(counts), d]: expert ``i`` (local order) on the ``counts[i]`` rows of its slice.

        Each expert is its own dense GEMMs over a contiguous slice; an empty slice is not run.
        """
        outs = []
        for expert, chunk in zip(self.values(), x.split(counts), strict=True):
            outs.append(_output(expert(chunk)) if chunk.shape[0] else chunk)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def run_buffer(self, x: Tensor) -> Tensor:
        """[E_local, S, d] -> [E_local, S, d]: expert ``i`` on row block ``i`` (capacity path)."""
        return torch.stack(
            [_output(e(chunk)) for e, chunk in zip(self.values(), x.unbind(0), strict=True)]
        )
