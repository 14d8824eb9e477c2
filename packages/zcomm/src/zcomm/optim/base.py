"""What the three 1-bit optimizers share: the compressed all-reduce and zcore's context.

Each is a ``torch.optim.Optimizer`` over zcore's flat fp32 master tensors (one per param
group, as DeepSpeed's fp16 optimizer hands its 1-bit optimizers one flat fp32 group).
zcore calls :meth:`OneBitBase.bind` once (:mod:`zcore.zero.communicating`), which gives the
data-parallel :class:`~zcore.comm.Comm` the compressed all-reduce runs over, and each
parameter's place in the flat tensors (LAMB's per-parameter trust ratio needs it).

At ZeRO stages 1-2 an optimizer may also compress the weights' all-gather (zcore's
:class:`~zcore.zero.communicating.CompressedGather`); 1-bit Adam does (:mod:`zcomm.optim.
onebit_adam`), from the denominators :meth:`OneBitBase.denominator_grid` all-gathers.
"""

from __future__ import annotations

from typing import Any

import torch

from zcomm.compressed import CompressedAllReduce
from zcomm.compressed_scatter import CompressedReduceScatter
from zcore.zero.communicating import OptimizerContext


class OneBitBase(torch.optim.Optimizer):
    """A torch optimizer that averages (some of) its inputs 1-bit compressed."""

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self.context: OptimizerContext | None = None
        self.allreduce: CompressedAllReduce | None = None
        self.scatter: CompressedReduceScatter | None = None
        self._d_grids: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gather_bytes = 0

    def bind(self, context: OptimizerContext) -> None:
        """Take zcore's context (the data-parallel comm, the parameters' segments)."""
        self.context = context
        self.allreduce = CompressedAllReduce(context.comm)
        self.scatter = CompressedReduceScatter(context.comm)

    @property
    def stage(self) -> int:
        return 0 if self.context is None else self.context.stage

    def reduce_scatter_local(self, grid: torch.Tensor, key: str) -> torch.Tensor:
        """Stages 1-2: this rank's row of the average of every rank's ``grid``, 1-bit
        compressed with worker error feedback (:mod:`zcomm.compressed_scatter`)."""
        assert self.scatter is not None, "bind() first"
        return self.scatter(grid, key)

    def denominator_grid(self, gi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stages 1-2: every slot's ``sqrt(v) + eps`` of group ``gi`` as a ``(world, P)``
        grid, and where ``v > 0``, all-gathered when first needed after the variance last
        changed (every rank asks at the same point of the same step). Where ``v`` is still
        0 (an element that never had a gradient) the denominator is 1 and the mask False:
        dividing by ``eps`` there would hand one sign scale a 1e8-times larger value."""
        cached = self._d_grids.get(gi)
        if cached is None:
            assert self.context is not None, "bind() first"
            group = self.param_groups[gi]
            p = group["params"][0]
            st = self.state.get(p)
            if st and "exp_avg_sq" in st:
                v = st["exp_avg_sq"].reshape(-1)
                mine = torch.where(v > 0, v.sqrt().add_(group["eps"]), -1.0)
            else:
                mine = torch.full_like(p.reshape(-1), -1.0)
            signed = torch.empty(self.world, mine.numel(), dtype=mine.dtype, device=mine.device)
            what = f"all_gather(variance denominators of group {gi})"
            self.context.comm.all_gather(signed.view(-1), mine, what).wait()
            seen = signed > 0
            cached = (torch.where(seen, signed, 1.0), seen)
            self._d_grids[gi] = cached
        return cached

    def preconditioned_scatter(self, grid: torch.Tensor, key: str) -> torch.Tensor:
        """The compressed reduce-scatter of ``grid / (sqrt(v) + eps)``, multiplied back: one
        sign scale then fits every element (zero where ``v`` is 0, as the momentum mask)."""
        gi = int(key.rsplit(".", 1)[1])
        d_grid, seen = self.denominator_grid(gi)
        rank = self.context.comm.rank if self.context else 0
        avg = OneBitBase.reduce_scatter_local(self, (grid / d_grid).mul_(seen), key)
        return avg.mul_(d_grid[rank]).mul_(seen[rank])

    @property
    def world(self) -> int:
        return 1 if self.context is None else self.context.comm.size

    def average(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """``t`` averaged over the ranks, 1-bit compressed with error feedback (``key``
        names its error buffers); ``t`` itself on one rank."""
        if self.world == 1:
            return t
        assert self.allreduce is not None
        return self.allreduce(t, key)

    def completed_steps(self) -> int:
        """Steps taken so far (from the state, so a loaded checkpoint sets it)."""
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st:
                    return int(st["step"])
        return 0

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has handed to compressed collectives so far."""
        sent = 0 if self.allreduce is None else self.allreduce.bytes_sent
        sent += 0 if self.scatter is None else self.scatter.bytes_sent
        return sent + self.gather_bytes

    # -- per-rank state (error feedback) -------------------------------------------------------
    def comm_state_dict(self) -> dict[str, Any]:
        return {
            "allreduce": None if self.allreduce is None else self.allreduce.state_dict(),
            "scatter": None if self.scatter is None else self.scatter.state_dict(),
        }

    def load_comm_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.allreduce is None:
            return
        if state is None or state.get("allreduce") is None:
            self.allreduce.reset()
        else:
            self.allreduce.load_state_dict(state["allreduce"])
        assert self.scatter is not None
        if state is None or state.get("scatter") is None:
            self.scatter.reset()
        else:
            self.scatter.load_state_dict(state["scatter"])
        self.after_load()

    def after_load(self) -> None:
        """Recompute what follows from the loaded step count (a subclass's phase)."""
        self._d_grids.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.after_load()
