"""Tied layers across pipeline ranks: one copy per rank, equal values, summed gradients.

A ``TiedLayerSpec`` key used by stages on different pipeline coordinates (an embedding on
the first stage, the output head reading it on the last) has a copy on each of those
ranks. The copies start as the first holder's and stay equal because their gradients are
summed across the tie before every step (DeepSpeed's tied-module all-reduce). The sum runs
over the ``pp`` comm; ranks between the holders add zeros, so no process group beyond the
mesh's is created; they learn the shapes to send (a tensor-parallel shard's, under ``tp``)
from the first holder once. Keys whose stages all sit on one rank (ZB-V's first and last
stage) need nothing: autograd already sums the two uses.

Every holder then steps the same gradient, so the global gradient norm would count a tie
once per holder: :meth:`Ties.norm_overlap` gives the squares the holders after the first
count again, which the optimizer takes off the norm.
"""

from __future__ import annotations

import torch
from torch import nn

from zcore.comm import Comm
from zcore.pipe.module import PipelineModule
from zcore.pipe.spec import TiedLayerSpec
from zcore.zero.axes import param_axis
from zcore.zero.store import sq_norm


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
        self.shapes: dict[str, list[tuple[int, ...]]] = {}
        for key in self.keys:
            if len(self.holders[key]) < pp.size:
                self.shapes[key] = self._agree_shapes(key)

    def _agree_shapes(self, key: str) -> list[tuple[int, ...]]:
        """The tied parameters' shapes on the first holder, on every ``pp`` rank."""
        spec = next(s for s in self.model.specs if isinstance(s, TiedLayerSpec) and s.key == key)
        out = []
        for i, attr in enumerate(spec.tied_weight_attr):
            meta = torch.zeros(9, dtype=torch.int64, device=self.device)
            if key in self.model.tied:
                shape = self.model.tied_parameters(key)[i].shape
                meta[0] = len(shape)
                meta[1 : 1 + len(shape)] = torch.tensor(shape)
            what = f"broadcast(tied {key}.{attr} shape)"
            self.pp.broadcast(meta, self.holders[key][0], what).wait()
            meta = meta.cpu()
            out.append(tuple(int(v) for v in meta[1 : 1 + int(meta[0])]))
        return out

    def _tensors(self, key: str) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
        """This rank's tied parameters (none between the holders) and what it sends."""
        if key in self.model.tied:
            params = self.model.tied_parameters(key)
            return params, [p.data for p in params]
        zeros = [torch.zeros(s, dtype=self.dtype, device=self.device) for s in self.shapes[key]]
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

    def norm_overlap(self, data: list[Comm], stage: int) -> dict[str, float]:
        """Per axis, the squares of this rank's tied gradients that the first holder counts
        already (none on the first holder), as this rank's share of the global norm: the
        gradient averaged over the data-parallel ``data`` comms as the reducer will, and at
        ZeRO ``stage`` >= 1 split evenly over the ``dp`` partitions (``data[0]``). Call after
        :meth:`reduce_grads`; collective over ``data`` on the holders after the first."""
        out: dict[str, float] = {}
        ranks = 1
        for comm in data:
            ranks *= comm.size
        for key in self.keys:
            if key not in self.model.tied or self.pp.rank == self.holders[key][0]:
                continue
            for p in self.model.tied_parameters(key):
                g = p.grad.detach().float().clone()
                for comm in data:
                    if comm.size > 1:
                        comm.all_reduce(g, f"all_reduce(tied {key} gradient norm)").wait()
                share = sq_norm(g / ranks) / (data[0].size if stage >= 1 else 1)
                axis = param_axis(p)
                out[axis] = out.get(axis, 0.0) + share
        return out
