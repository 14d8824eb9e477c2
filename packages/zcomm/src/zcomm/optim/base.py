"""What the three 1-bit optimizers share: the compressed all-reduce and zcore's context.

Each is a ``torch.optim.Optimizer`` over zcore's flat fp32 master tensors (one per param
group, as DeepSpeed's fp16 optimizer hands its 1-bit optimizers one flat fp32 group).
zcore calls :meth:`OneBitBase.bind` once (:mod:`zcore.zero.communicating`), which gives the
data-parallel :class:`~zcore.comm.Comm` the compressed all-reduce runs over, and each
parameter's place in the flat tensors (LAMB's per-parameter trust ratio needs it).
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
        return sent + (0 if self.scatter is None else self.scatter.bytes_sent)

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.after_load()
