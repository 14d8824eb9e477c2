"""Gradients accumulated straight into the kept gradient partition (one rank per slot).

Where a stage's gradient partition is its gradients laid end to end (one slot per
parameter: ``dp`` 1 or ZeRO stage 0, fp32 gradients accumulated in fp32, no stage 3, the
reducers' ``direct`` path: no bucket, no collective, no scaling), the pipeline engine lends
each parameter a view of its slot as ``.grad`` before the schedule (DDP's
``gradient_as_bucket_view``): autograd adds every micro-batch's gradient into it in place,
so the boundary has nothing to copy and no model-sized gradient is allocated per step.

After the schedule (and the ties' sum, which works on ``.grad`` in place) each view is
taken back: a ``.grad`` still on its view is in the partition already and is dropped; one
that something replaced holds the whole gradient, so its slot is zeroed and the ordinary
reduction adds it. The values are the same as the reduction's: ``0 + g1 + g2 + ...`` in
the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from zcore.zero.optimizer import ZeroOptimizer
from zcore.zero.store import MemoryStore


def _on(grad: torch.Tensor | None, view: torch.Tensor) -> bool:
    return grad is not None and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape


class GradViews:
    """Lends and takes back the partition views of one optimizer's parameters."""

    def __init__(self, zopt: ZeroOptimizer) -> None:
        self.zopt = zopt
        self.active = self._valid()
        self._lent: list[tuple[nn.Parameter, torch.Tensor]] = []

    def _valid(self) -> bool:
        z = self.zopt
        store = z.store
        if not isinstance(store, MemoryStore) or not store.keep_grad_partitions:
            return False
        if z.stage3 is not None or z.local is not None or z.communicator is not None:
            return False
        if not all(r.direct and r.postscale == 1.0 for r in z.reducers.values()):
            return False
        device = store.master[0].device if store.master else None
        for g, (ps, layout) in enumerate(zip(z.params, z.layouts, strict=True)):
            wire = z.reducers[z.group_axis[g]].comm_dtype
            if layout.world != 1:
                return False
            for p, shard in zip(ps, layout.shards, strict=True):
                if (
                    p.dtype != z.grad_accum_dtype
                    or p.device != device
                    or shard.shard_size != p.numel()
                    or wire not in (None, p.dtype)
                ):
                    return False
        return True

    def lend(self) -> None:
        """A fresh cycle: every parameter's ``.grad`` becomes its zeroed partition slot (a
        gradient it already holds is carried into the slot)."""
        if not self.active:
            return
        z = self.zopt
        z.store.zero_grad()  # the next partition() zeroes the kept buffer
        self._lent = []
        for g, ps in enumerate(z.params):
            part = z.store.partition(g)  # type: ignore[attr-defined]
            for p in ps:
                shard = z.where[p][1]
                view = part[shard.offset : shard.offset + shard.numel].view(p.shape)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._lent.append((p, view))

    def take_back(self) -> None:
        """Drop the ``.grad`` that are their slots; zero the slots of those replaced."""
        for p, view in self._lent:
            if _on(p.grad, view):
                p.grad = None
            else:
                view.zero_()
        self._lent = []
