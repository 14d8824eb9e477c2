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
import torch.nn.functional as F
from torch import Tensor, nn

from zmoe.expert_mlp import batched_mlp, grouped_mlp, is_linear_act_linear, sliced_mlp

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
        self.fused = is_linear_act_linear(expert)
        """Whether the experts (Linear, a row-wise activation, Linear) run as one fused call
        over every slice (:mod:`zmoe.expert_mlp`) rather than one module call each."""
        self.grouped = self.fused and hasattr(torch, "_grouped_mm")
        """Whether that call is ``torch._grouped_mm`` off the CPU (the CPU runs
        :func:`~zmoe.expert_mlp.sliced_mlp`, measured faster there); turned off for good if
        the backend refuses it."""
        self.grouped_on_cpu = False
        """Use ``torch._grouped_mm`` on the CPU too (tests compare the two kernels)."""
        self.fused_on_cpu = False
        """Use the fused kernels on the CPU too. Off: the CPU runs one module call per expert,
        whose hidden activation (rows x ffn) stays in cache between its two GEMMs; on an idle
        2-core machine that measured 1.1-1.4x the batched kernel (T=4096, d=256, ffn 1024,
        8 experts, top-2), which wins only while other processes crowd the cores."""

    def run_slices(self, x: Tensor, counts: list[int]) -> Tensor:
        """[sum(counts), d]: expert ``i`` (local order) on the ``counts[i]`` rows of its slice.

        Linear-activation-Linear experts run as one fused call over every slice (a grouped
        GEMM per layer off the CPU); any other expert is its own module call on its slice.
        An empty slice is run too: every expert then gets a (zero) gradient at the same point
        of backward on every rank, which ZeRO's gradient buckets and stage 3's gathers need
        (an expert routed tokens on one rank only would otherwise enter backward there alone).
        """
        if self._fused_on(x) and x.shape[0]:
            experts = list(self.values())
            if self.grouped and (x.device.type != "cpu" or self.grouped_on_cpu):
                try:
                    return grouped_mlp(experts, x, counts)
                except RuntimeError:  # e.g. a dtype or device the grouped kernel does not take
                    self.grouped = False
            return sliced_mlp(experts, x, counts)
        outs = []
        for expert, chunk in zip(self.values(), x.split(counts), strict=True):
            outs.append(_output(expert(chunk)))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def batched(self, x: Tensor) -> bool:
        """Whether :meth:`run_buffer` on ``x``'s device runs every expert in one batched
        kernel (so a padded buffer is cheap)."""
        return self._fused_on(x) and x.device.type == "cpu" and not self.grouped_on_cpu

    def _fused_on(self, x: Tensor) -> bool:
        return self.fused and (x.device.type != "cpu" or self.fused_on_cpu)

    def run_buffer(self, x: Tensor, filled: list[int] | None = None) -> Tensor:
        """[E_local, S, d] -> [E_local, S, d]: expert ``i`` on row block ``i`` (capacity path).

        ``filled[i]``: block ``i`` holds tokens in its first ``filled[i]`` rows only (slots
        fill in order); one module call per expert then runs on those rows alone and the
        empty slots' outputs are zeros, which no kept route reads.
        """
        local, slots, d = x.shape
        if slots and self.batched(x):
            return batched_mlp(list(self.values()), x)
        if self._fused_on(x) and slots:
            return self.run_slices(x.reshape(local * slots, d), [slots] * local).view(x.shape)
        if filled is None:
            return torch.stack(
                [_output(e(chunk)) for e, chunk in zip(self.values(), x.unbind(0), strict=True)]
            )
        outs = [
            F.pad(_output(e(chunk[:n])), (0, 0, 0, slots - n))
            for e, chunk, n in zip(self.values(), x.unbind(0), filled, strict=True)
        ]
        return torch.stack(outs)
