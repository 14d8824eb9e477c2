"""Inner optimizers that see the job: the seam 1-bit Adam, 0/1 Adam and LAMB plug into.

ZeRO's inner optimizer normally steps a flat fp32 partition and knows nothing of other
ranks: the engine has already averaged the gradients. Two kinds of optimizer need more:

* **layout-aware** ones (LAMB's per-parameter trust ratio) need to know where each whole
  parameter sits in the flat master tensor: :attr:`OptimizerContext.segments`;
* **communicating** ones (DeepSpeed's 1-bit Adam, 0/1 Adam, 1-bit LAMB) average what they
  need themselves, compressed, on some steps: the engine must then hand them each rank's
  *local* gradients instead of reducing them (DeepSpeed's ``enable_backward_allreduce =
  False``), and keep per-rank state (error feedback) across checkpoints.

An inner optimizer opts in by defining ``bind(context)``; the engine calls it once, after
the optimizer is built. ``zero_stages`` (default ``(0,)``) lists the stages it runs at; at
stages 1-2 local gradients are kept as a ``(world, P)`` grid per group until the step, then
handed to :meth:`CommunicatingOptimizer.reduce_scatter_local`, whose result (this rank's
averaged slot) becomes the gradient partition. A communicating one also defines :meth:`reduce_gradients` (asked
while gradients arrive: False means "give me this cycle's local gradients") and
``comm_state_dict`` / ``load_comm_state_dict`` (per global rank; checkpoints write one
file per rank for it). The protocol lives in zcore so that zcomm edits no engine code.

At stages 1-2 the weights' all-gather after each step costs as much as the gradients'
reduce-scatter, so compressing only the gradients saves at most half. A communicating
optimizer may also implement :class:`CompressedGather`: while ``compress_gather()`` says
so, each owner sends what its update was made from, compressed (1-bit Adam: the signs and
block scales of its compressed momentum), and every rank replays every owner's update on
the slots it holds (``gather_slots``); the owner sets its master slot to the same replay,
so model and master stay equal bit for bit and nothing is approximated beyond what the
optimizer's own update already was. Only for fp32 parameters (a bf16 model cannot hold
the master's values to replay from); other dtypes are gathered as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from zcore.comm import Comm


@dataclass(frozen=True)
class OptimizerContext:
    """What :meth:`BoundOptimizer.bind` is told about the job."""

    comm: Comm
    """The data-parallel ranks gradients are averaged over (ZeRO's ``dp`` axis)."""
    stage: int
    """The ZeRO stage (0: every rank holds the whole master; 1-2: a partition)."""
    segments: list[list[tuple[str, int, int]]]
    """Per param group: ``(name, offset, numel)`` of each parameter's part of this rank's
    flat master tensor (at stage 0 each parameter whole)."""
    fp32_params: bool = False
    """Whether every model parameter is fp32, so that at stages 1-2 a
    :class:`CompressedGather` fills every chunk of the weights' all-gather."""


@runtime_checkable
class BoundOptimizer(Protocol):
    """An inner optimizer that wants :class:`OptimizerContext`."""

    def bind(self, context: OptimizerContext) -> None: ...


@runtime_checkable
class CommunicatingOptimizer(BoundOptimizer, Protocol):
    """An inner optimizer that averages (some of) its inputs across ranks itself."""

    def reduce_gradients(self) -> bool:
        """Whether the engine averages the gradients of the cycle now under way (True) or
        hands each rank its local gradients (False). Changes only in ``step``."""
        ...

    def reduce_scatter_local(self, grid: torch.Tensor, key: str) -> torch.Tensor:
        """Stages 1-2: average a group's ``(world, P)`` local gradient grid across the
        ranks, returning this rank's row (``zero_stages`` says whether it can)."""
        ...

    def comm_state_dict(self) -> dict[str, Any]:
        """This rank's own state (error feedback, local drift); saved per global rank."""
        ...

    def load_comm_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take back :meth:`comm_state_dict`; None: the checkpoint has none for this rank
        (another world size, or saved before compression): start it afresh."""
        ...


@runtime_checkable
class CompressedGather(Protocol):
    """Optional: a communicating optimizer that compresses the stages 1-2 weight all-gather."""

    def compress_gather(self) -> bool:
        """Whether the all-gather after the step just taken sends compressed updates."""
        ...

    def gather_slots(self, held: torch.Tensor, key: str, group: int, offset: int) -> torch.Tensor:
        """Every rank's slot of columns ``offset:offset+P`` of group ``group`` after the step
        just taken, as a ``(world, P)`` fp32 grid equal on every rank: each owner's update
        replayed on ``held`` (the model's slots before the step, equal to the masters),
        the owner's master slot set to its own row.

        An optimizer whose ranks may hold *different* models between steps (0/1 Adam's
        local steps) returns this rank's own rows instead, and may define
        ``restored_slots(key, group, offset, width)``: after a checkpoint load (a publish
        with no step) it returns the ``(world, width)`` rows this rank held when the
        checkpoint was saved, or None to gather the masters as usual."""
        ...


def communicator_of(optimizer: Any) -> CommunicatingOptimizer | None:
    """``optimizer`` as a communicating optimizer, or None."""
    return optimizer if isinstance(optimizer, CommunicatingOptimizer) else None


def bind_inner(zopt: Any, comm: Comm, *, replicas: int, type_name: str) -> None:
    """Hand the inner optimizer of ``zopt`` (a ZeroOptimizer) its context, if it wants one,
    and route gradients through it when it communicates. Raises ValueError naming the
    config key when the job is one it cannot run in."""
    from zcore.zero.store import MemoryStore

    inner = zopt.optimizer
    if not isinstance(inner, BoundOptimizer):
        return
    talker = communicator_of(inner)
    if talker is not None:
        where = f"optimizer.type {type_name}"
        stages = tuple(getattr(inner, "zero_stages", (0,)))
        if zopt.stage not in stages:
            why = getattr(inner, "stage_limit", "it needs whole parameters on every rank")
            raise ValueError(
                f"{where} runs at ZeRO stage {' or '.join(map(str, stages))} ({why}); "
                f"zero_optimization.stage is {zopt.stage}: set it to {stages[-1]}, or use "
                '"Adam" with ZeRO++ `zero_quantized_gradients`, which compresses the '
                "gradients of stage 3"
            )
        if replicas > 1 or len(zopt.reducers) > 1:
            raise ValueError(
                f"{where} averages over one data-parallel group; this job also has "
                "MiCS replicas (zero_optimization.mics_shard_size) or expert-parallel groups: "
                "remove mics_shard_size, or train the MoE model with Adam"
            )
        if not isinstance(zopt.store, MemoryStore):
            raise ValueError(
                f"{where} keeps its momentum in memory; zero_optimization.offload_optimizer."
                'device "nvme" swaps it in pieces: use device "cpu" or "none"'
            )
    fp32 = all(p.dtype == torch.float32 for ps in zopt.params for p in ps)
    inner.bind(OptimizerContext(comm, zopt.stage, zopt.segments(), fp32_params=fp32))
    zopt.communicator = talker
