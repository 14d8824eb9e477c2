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

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from zcore.comm import Comm
from zcore.zero.layout import ParamShard, slot_view
from zcore.zero.store import sq_norm

if TYPE_CHECKING:
    from zcore.zero.optimizer import ZeroOptimizer


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
    zopt.local = LocalGradients(talker, zopt) if talker is not None else None


class LocalGradients:
    """The ZeRO optimizer's side of a communicating inner optimizer: while the optimizer
    asks for local gradients, each rank keeps its own (stage 0: in the partition; stages
    1-2: a ``(world, P)`` grid per group until the step, then the optimizer's compressed
    reduce-scatter), measures their norm and overflow, and at stages 1-2 may fill the
    weights' all-gather from the owners' compressed updates (:class:`CompressedGather`)."""

    def __init__(self, talker: CommunicatingOptimizer, zopt: ZeroOptimizer) -> None:
        self.talker = talker
        self._zopt = zopt
        self._grids: dict[int, torch.Tensor] = {}
        self._sq, self._nonfinite = 0.0, False

    @property
    def active(self) -> bool:
        """Whether this cycle's gradients stay on their rank (the optimizer averages them)."""
        return not self.talker.reduce_gradients()

    def add(self, g: int, shard: ParamShard, grad: torch.Tensor) -> None:
        """Keep one parameter's local gradient (``shard`` of group ``g``)."""
        zopt = self._zopt
        if zopt.stage == 0:  # the partition is the whole flat group
            zopt.store.accumulate(g, shard, grad.reshape(-1), 1.0)
            return
        w = zopt.group_world(g)  # every rank's slot of it, kept until the step
        grid = self._grids.get(g)
        if grid is None:
            grid = self._grids[g] = torch.zeros(
                w, zopt.layouts[g].numel, dtype=torch.float32, device=grad.device
            )
        cols = grid[:, shard.offset : shard.offset + shard.shard_size]
        cols.add_(slot_view(grad.reshape(-1), shard, w))

    def reduce(self) -> None:
        """Stages 1-2: each group's grid goes through the optimizer's own (compressed)
        reduce-scatter, and this rank's averaged row lands in its gradient partition."""
        if not self._grids:
            return
        zopt = self._zopt
        # what the compression hides: the local gradients' norm (for clipping, as at stage
        # 0) and whether they overflowed (signs of inf and NaN are just +1)
        self._sq = sum(sq_norm(t) for t in self._grids.values())  # fp32 drift-free
        self._nonfinite = not math.isfinite(self._sq)
        for g, grid in sorted(self._grids.items()):
            avg = self.talker.reduce_scatter_local(grid, f"grad.{g}")
            for shard in zopt.layouts[g].shards:
                at = slice(shard.offset, shard.offset + shard.shard_size)
                zopt.store.accumulate(g, shard, avg[at], 1.0)
        self._grids.clear()

    def nonfinite(self) -> bool:
        """Whether this rank's local gradients overflowed (stages 1-2; stage 0: the store's)."""
        return self.active and self._nonfinite

    def grad_norm(self, inv_scale: float) -> float:
        """Every rank's own gradients: the root mean square of their norms, the same on
        every rank (so is the clipping), and the true norm when they agree (stages 1-2:
        measured before the compressed reduce-scatter)."""
        zopt = self._zopt
        local = zopt.store.grad_sq_norm() if zopt.stage == 0 else self._sq
        sq = zopt.comm.sum_scalar(local, "all_reduce(local grad norms)")
        return math.sqrt(sq / zopt.comm.size) * inv_scale

    def gather(
        self,
        comm: Comm,
        chunk: list[nn.Parameter],
        inp: torch.Tensor,
        grid: torch.Tensor,
        stepped: bool,
    ) -> bool:
        """Stages 1-2 with a :class:`CompressedGather` on fp32 parameters: fill ``grid`` with
        every rank's slots of ``chunk`` replayed from the owners' compressed updates (after
        a step) or restored from the checkpoint (a publish after a load), and return True.
        False: gather ``inp`` as usual."""
        talker, where = self.talker, self._zopt.where
        if self._zopt.stage not in (1, 2) or not isinstance(talker, CompressedGather):
            return False
        if inp.dtype != torch.float32 or not talker.compress_gather():
            return False  # a model that cannot hold the master
        runs = _adjacent_runs([where[p] for p in chunk])
        if not stepped:  # a publish after a load: the rows saved, if the talker has them
            restore = getattr(talker, "restored_slots", None)
            if restore is None:
                return False
            rows = [
                restore(f"weights.{g}.{first.offset}", g, first.offset, _width(run))
                for run in runs
                for g, first in run[:1]
            ]
            if not rows or any(r is None for r in rows):
                return False
            grid.copy_(torch.cat(rows, dim=1))
            return True
        held = torch.cat(
            [slot_view(p.data.reshape(-1), where[p][1], comm.size) for p in chunk], dim=1
        )
        col = 0  # one call per run of parameters adjacent in one group's master slot
        for run in runs:
            g, first = run[0]
            cols = slice(col, col + _width(run))
            key = f"weights.{g}.{first.offset}"
            grid[:, cols] = talker.gather_slots(held[:, cols], key, g, first.offset)
            col += _width(run)
        return True


def _width(run: list[tuple[int, ParamShard]]) -> int:
    return sum(s.shard_size for _, s in run)


def _adjacent_runs(at: list[tuple[int, ParamShard]]) -> list[list[tuple[int, ParamShard]]]:
    """``(group, shard)`` pairs cut into runs that sit next to each other in one group's
    flat master slot, in order."""
    runs: list[list[tuple[int, ParamShard]]] = []
    for g, s in at:
        last = runs[-1][-1] if runs else None
        if last is not None and last[0] == g and s.offset == last[1].offset + last[1].shard_size:
            runs[-1].append((g, s))
        else:
            runs.append([(g, s)])
    return runs
