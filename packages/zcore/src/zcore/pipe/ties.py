"""Tied layers across pipeline ranks: one copy per rank, equal values, summed gradients.

A ``TiedLayerSpec`` key used by stages on different pipeline coordinates (an embedding on
the first stage, the output head reading it on the last) has a copy on each of those
ranks. The copies start as the first holder's and stay equal because their gradients are
summed across the tie before every step (DeepSpeed's tied-module all-reduce). The sum runs
over the ``pp`` comm; ranks between the holders add zeros, so no process group beyond the
mesh's is created. Keys whose stages all sit on one rank (ZB-V's first and last stage)
need nothing: autograd already sums the two uses.
"""

from __future__ import annotations

import torch
from torch import nn

from zcore.comm import Comm
from zcore.pipe.module import PipelineModule
from zcore.pipe.spec import TiedLayerSpec


def coord_of(stage: int, pp: int, order: str) -> int:
    """The pipeline coordinate holding ``stage``."""
    if order == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


class Ties:
    """The tie keys of ``model`` spanning pipeline ranks, with their collectives."""

    def __init__(
        self, model: PipelineModule, pp: Comm, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.model, self.pp, self.dtype, self.device = model, pp, dtype, device
        self.holders: dict[str, list[int]] = {}
        for key, stages in model.tie_stages.items():
            coords = sorted({coord_of(s, pp.size, model.stage_order) for s in stages})
            if len(coords) > 1:
                self.holders[key] = coords
        self.keys = sorted(self.holders)
        self.crosses_ranks = bool(self.keys)

    def _tensors(self, key: str) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
        """This rank's tied parameters (none between the holders) and what it sends."""
        if key in self.model.tied:
            params = self.model.tied_parameters(key)
            return params, [p.data for p in params]
        spec = next(s for s in self.model.specs if isinstance(s, TiedLayerSpec) and s.key == key)
        meta = spec.build_meta()
        zeros = [
            torch.zeros(getattr(meta, a).shape, dtype=self.dtype, device=self.device)
            for a in spec.tied_weight_attr
        ]
        return [], zeros

    def sync_initial(self) -> list[nn.Parameter]:
        """Give every holder the first holder's values; returns the parameters changed."""
        changed: list[nn.Parameter] = []
        for key in self.keys:
            params, tensors = self._tensors(key)
            for t in tensors:
                self.pp.broadcast(t, self.holders[key][0], f"broadcast(tied {key})").wait()
            changed += params
        return changed

    def reduce_grads(self) -> None:
        """Sum each tied parameter's gradient across its holders (after the schedule)."""
        for key in self.keys:
            params, tensors = self._tensors(key)
            grads = []
            for i, t in enumerate(tensors):
                if params:
                    p = params[i]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grads.append(p.grad)
                else:
                    grads.append(t)
            for g in grads:
                self.pp.all_reduce(g, f"all_reduce(tied {key} gradient)").wait()
