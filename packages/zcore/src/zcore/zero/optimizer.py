"""The partitioned optimizer: fp32 master weights, optimizer state and gradients per rank.

Stage 0 keeps everything whole on every rank (layout cut for one rank, gradients
all-reduced). Stages 1-3 cut the layout across the data-parallel ranks: each rank steps
only its slots with an ordinary ``torch.optim`` optimizer built over one flat fp32 tensor
per parameter group, then the new weights go back to the model (stages 1-2: all-gathered
into every rank's full parameters; stage 3: into the rank's own shards).

Where the master weights, the optimizer state and the gradient partitions live is the
injected :class:`~zcore.zero.store.OptimizerStore`'s business (memory by default; zoffload's
CPU and NVMe stores), and how buckets and parameters travel is the injected
:class:`~zcore.zero.collectives.Collectives`'; any store combines with any collectives.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn

from zcore.comm import Comm
from zcore.zero.axes import GroupAxis
from zcore.zero.collectives import Collectives
from zcore.zero.communicating import CommunicatingOptimizer, LocalGradients
from zcore.zero.layout import GroupLayout, ParamShard, from_slots, own_slot
from zcore.zero.partition import Partition
from zcore.zero.reducer import GradReducer
from zcore.zero.stage3 import Stage3Params
from zcore.zero.store import MemoryStore, OptimizerFactory, OptimizerStore

CPU_GATHER_ELEMS = 1 << 24
"""Elements per all-gather of updated CPU parameters at most (``allgather_bucket_size`` may
ask for fewer). gloo, which carries CPU tensors, gathers through a temporary as large as its
output: a model-sized gather would hold a second copy of the model at the step's peak."""

CPU_BUCKET_ELEMS = 1 << 24
"""Elements per gradient bucket of CPU parameters at most (``reduce_bucket_size`` may ask for
fewer). A bucket buffer is kept from one backward to the next and is idle while the optimizer
steps: with DeepSpeed's default ``reduce_bucket_size`` (5e8) it is as large as the model, and
its pages would stay resident through the step's peak (the inner optimizer's temporaries)."""


class ZeroOptimizer:
    """Master weights, gradient partitions and the inner optimizer of one rank."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        names: dict[nn.Parameter, str],
        stage: int,
        comm: Comm,
        make_optimizer: OptimizerFactory,
        *,
        stage3: Stage3Params | None,
        grad_accum_dtype: torch.dtype,
        comm_dtype: torch.dtype | None,
        reduce_bucket_elems: int,
        allgather_bucket_elems: int,
        overlap_comm: bool,
        reduce_scatter: bool = True,
        predivide: float | None = None,
        allgather_partitions: bool = True,
        replicas: Comm | None = None,
        collectives: Collectives | None = None,
        store: OptimizerStore | None = None,
        axes: dict[str, GroupAxis] | None = None,
    ) -> None:
        self.stage = stage
        self.comm = comm
        data_parallel = comm.size * (replicas.size if replicas is not None else 1)
        self.axes = axes or {"dp": GroupAxis("dp", comm, replicas)}
        """The axes groups are sharded over (:mod:`zcore.zero.axes`); ``"dp"`` always."""
        self.collectives = collectives or Collectives()
        self.stage3 = stage3
        self.shard_world = comm.size if stage >= 1 else 1
        """Ranks the dense (``dp``) groups are cut across; see :meth:`group_world`."""
        self.shard_rank = comm.rank if stage >= 1 else 0
        self.allgather_bucket_elems = max(1, allgather_bucket_elems)
        self.allgather_partitions = allgather_partitions
        self.params: list[list[nn.Parameter]] = [list(g["params"]) for g in groups]
        self.group_axis: list[str] = [g.get("axis", "dp") for g in groups]
        """The axis each group is sharded and reduced over."""
        for axis in set(self.group_axis) - set(self.axes):
            raise ValueError(f"a param group has axis {axis!r}; the axes are {sorted(self.axes)}")
        self.layouts = [
            GroupLayout.build([(names[p], tuple(self._shape(p))) for p in ps], self.group_world(g))
            for g, ps in enumerate(self.params)
        ]
        self.where: dict[nn.Parameter, tuple[int, ParamShard]] = {}
        for g, (ps, layout) in enumerate(zip(self.params, self.layouts, strict=True)):
            for p, shard in zip(ps, layout.shards, strict=True):
                self.where[p] = (g, shard)
        self.grad_accum_dtype = grad_accum_dtype
        self._gather_out: dict[torch.dtype, torch.Tensor] = {}
        self.store = store or MemoryStore()
        """Where the master, the optimizer state and the gradient partitions live."""
        hyper = [{k: v for k, v in g.items() if k not in ("params", "axis")} for g in groups]
        self.store.attach(self.partition(), make_optimizer, hyper)
        # one reducer per axis in use (dense first): each buckets its groups' gradients
        self.reducers: dict[str, GradReducer] = {}
        on_cpu = all(p.device.type == "cpu" for ps in self.params for p in ps)
        bucket_elems = min(reduce_bucket_elems, CPU_BUCKET_ELEMS) if on_cpu else reduce_bucket_elems
        for axis in dict.fromkeys(["dp", *self.group_axis]):
            ax = self.axes[axis]
            world = ax.shard.size if stage >= 1 else 1
            elems = sum(
                layout.numel
                for layout, a in zip(self.layouts, self.group_axis, strict=True)
                if a == axis
            )
            self.reducers[axis] = GradReducer(
                ax.shard,
                self.store.accumulate,
                world,
                bucket_elems,
                overlap_comm,
                comm_dtype,
                predivide=float(data_parallel if predivide is None else predivide),
                postscale=1.0 if predivide is None else predivide / data_parallel,
                reduce_scatter=reduce_scatter,
                replicas=ax.replicas,
                collectives=self.collectives,
                total_elems=elems * world,
            )
        if stage3 is not None:
            stage3.on_repartition.append(self.refresh_master)
        self.last_grad_norm: float | None = None
        self.norm_overlap: dict[str, float] = {}
        """Per axis, the squares this rank's gradient partitions count that another rank's
        count too (a pipeline tie's copies), as this rank's share before the sums across
        ranks; :meth:`global_grad_norm` takes them off (its owner sets them each step)."""
        self.communicator: CommunicatingOptimizer | None = None
        """The inner optimizer when it averages across ranks itself (1-bit Adam; see
        :mod:`zcore.zero.communicating`): while it says so, gradients stay local."""
        self.local: LocalGradients | None = None
        """This rank's local gradients while the communicator asks for them."""
        self._stepped = False
        """True while the publish after a step runs (only it may replay compressed updates)."""

    def partition(self) -> Partition:
        """What the store sees of this optimizer (:mod:`zcore.zero.partition`)."""
        return Partition(
            params=self.params,
            layouts=self.layouts,
            where=self.where,
            stage=self.stage,
            grad_accum_dtype=self.grad_accum_dtype,
            comm=self.comm,
            slot_of=self.slot_of,
            stage3=self.stage3,
        )

    def group_world(self, g: int) -> int:
        """Ranks group ``g`` is cut across (1 at stage 0)."""
        return self.axes[self.group_axis[g]].shard.size if self.stage >= 1 else 1

    def group_rank(self, g: int) -> int:
        """This rank's slot in group ``g``'s layout."""
        return self.axes[self.group_axis[g]].shard.rank if self.stage >= 1 else 0

    def owns_group(self, g: int) -> bool:
        """Whether this rank writes group ``g``'s partition to checkpoints: the first
        replica and mirror of each slot (stage 0: of the whole group)."""
        ax = self.axes[self.group_axis[g]]
        return ax.first_copy and (self.stage >= 1 or ax.shard.rank == 0)

    # -- construction ---------------------------------------------------------------------
    def _shape(self, p: nn.Parameter) -> torch.Size:
        if self.stage3 is not None and p in self.stage3.params:
            return self.stage3.params[p].shape
        return p.shape

    def slot_of(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's slot of ``p`` as fp32 (from the stage-3 shard or the full value)."""
        g, shard = self.where[p]
        if self.stage3 is not None and p in self.stage3.params:
            return self.stage3.shard_of(p).float()
        return own_slot(p.data.float(), shard, self.group_rank(g))

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer (its param groups carry the hyperparameters)."""
        return self.store.optimizer

    @property
    def master(self) -> list[torch.Tensor]:
        """The fp32 master partitions held in memory (none when the store keeps them elsewhere)."""
        return self.store.live_master

    def refresh_master(self, p: nn.Parameter) -> None:
        """``p``'s full value was edited: take this rank's slot of it into the master weights.

        Parameters outside every optimizer group (frozen ones, partitioned at stage 3 like
        the rest) have no master weights: their shard alone holds the edit.
        """
        if p in self.where:
            self.store.refresh(p)

    def segments(self) -> list[list[tuple[str, int, int]]]:
        """Per group, ``(name, offset, numel)`` of each parameter's elements in this rank's
        flat master (what :class:`~zcore.zero.communicating.OptimizerContext` hands on)."""
        out = []
        for g, layout in enumerate(self.layouts):
            rank = self.group_rank(g)
            out.append(
                [
                    (s.name, s.offset, max(0, s.owned(rank)[1] - s.owned(rank)[0]))
                    for s in layout.shards
                ]
            )
        return out

    # -- gradients ------------------------------------------------------------------------
    @property
    def local_gradients(self) -> bool:
        """Whether this cycle's gradients stay on their rank (a communicating optimizer
        averages them itself), instead of being reduced across ranks."""
        return self.local is not None and self.local.active

    def on_grad(self, p: nn.Parameter) -> None:
        """Move ``p.grad`` into a reduction bucket and drop it from the parameter."""
        if p.grad is None or p not in self.where:
            return
        g, shard = self.where[p]
        if self.local is not None and self.local.active:
            self.local.add(g, shard, p.grad)
        else:
            self.reducers[self.group_axis[g]].add(g, shard, p.grad)
        p.grad = None

    def finish_reduction(self) -> None:
        """Flush every axis's last bucket and wait for its collectives."""
        for reducer in self.reducers.values():
            reducer.finish()

    def reduce_leftovers(self) -> None:
        """Reduce gradients still held by parameters (accumulated under ``no_sync``)."""
        for ps in self.params:
            for p in ps:
                if p.grad is not None:
                    self.on_grad(p)
        self.finish_reduction()
        if self.local is not None:
            self.local.reduce()

    def zero_grad(self) -> None:
        self.store.zero_grad()
        for ps in self.params:
            for p in ps:
                p.grad = None

    # -- step -----------------------------------------------------------------------------
    def grads_overflow(self) -> bool:
        """Whether any rank's gradients hold an inf or NaN: the flag is taken over each
        axis's shard and the axes holding different parameters, never over mirrors."""
        flag = self.store.grads_nonfinite() or (self.local is not None and self.local.nonfinite())
        comms: list[Comm] = []
        for axis in self.reducers:
            ax = self.axes[axis]
            comms += [c for c in (ax.shard, *ax.disjoint) if all(c is not k for k in comms)]
        for comm in comms:
            flag = comm.max_flag(flag, "all_reduce(fp16 overflow flag)")
        return flag

    def global_grad_norm(self, inv_scale: float) -> float:
        """The norm of the whole job's gradient: each axis's partitions summed over its
        shard (stages 1-3) and over the axes holding different parameters, so every element
        counts once whatever the mesh; mirrors and replicas hold copies and are not summed."""
        if self.local is not None and self.local.active:
            return self.local.grad_norm(inv_scale)
        total = 0.0
        for axis in self.reducers:
            ax = self.axes[axis]
            one = len(self.reducers) == 1
            sq = self.store.grad_sq_norm([g for g, a in enumerate(self.group_axis) if a == axis])
            sq -= self.norm_overlap.get(axis, 0.0)
            if self.stage >= 1 and ax.shard.size > 1:
                what = "gradient norm" if one else f"gradient norm over {axis}"
                sq = ax.shard.sum_scalar(sq, f"all_reduce({what})")
            for comm in ax.disjoint:
                where = comm.axis or "the job"
                sq = comm.sum_scalar(sq, f"all_reduce(gradient norm of {axis} across {where})")
            total += sq
        return math.sqrt(total) * inv_scale

    def step(self, inv_scale: float, clip: float) -> float:
        """Unscale, clip by the global norm, step the master weights, publish them.

        Returns the global gradient norm before clipping.
        """
        norm = self.global_grad_norm(inv_scale)
        coef = inv_scale
        if clip > 0 and norm > clip:
            coef *= clip / (norm + 1e-6)
        self.update(coef)
        self._stepped = True  # this publish may replay the step (CompressedGather)
        try:
            self.publish()
        finally:
            self._stepped = False
        self.last_grad_norm = norm
        return norm

    def update(self, coef: float) -> None:
        """Step the master weights with the gradient partitions times ``coef``."""
        self.store.update(coef)

    def published(self, g: int) -> torch.Tensor | None:
        """The flat tensor group ``g``'s updated weights are published from (None: the
        store's step wrote them into the stage-3 shards already)."""
        return self.store.published(g)

    def _source(self, g: int) -> torch.Tensor:
        src = self.published(g)
        assert src is not None, "a store that publishes into the shards runs at stage 3"
        return src

    def publish(self) -> None:
        """Write the master weights back into the model's parameters."""
        if self.stage3 is not None:
            persistent = []
            for p, (g, shard) in self.where.items():
                sp = self.stage3.params.get(p)
                if sp is None:
                    continue
                src = self.published(g)
                if src is not None:
                    self.stage3.write_shard(p, src[shard.offset : shard.offset + shard.shard_size])
                if sp.persistent:
                    persistent.append(p)
            self.all_gather_params(persistent)
            return
        for ps in self.params:
            self.all_gather_params(ps)
        # a gather buffer of its own (a parameter larger than any idle bucket) is not kept
        # resident through the next backward and step
        self._gather_out.clear()

    def all_gather_params(self, params: list[nn.Parameter]) -> None:
        """Every rank's slots of ``params`` → their full ``.data``, in buckets (one run of
        buckets per axis the parameters are sharded over)."""
        axes = [self.group_axis[self.where[p][0]] for p in params]
        for axis in dict.fromkeys(axes):
            same = (
                params
                if len(set(axes)) == 1
                else [p for p, a in zip(params, axes, strict=True) if a == axis]
            )
            self._all_gather_axis(same, self.axes[axis].shard)

    def _all_gather_axis(self, params: list[nn.Parameter], comm: Comm) -> None:
        w = comm.size if self.stage >= 1 else 1
        if w == 1:
            for p in params:  # the slot is the whole parameter (from the shard at stage 3)
                s = self.where[p][1]
                p.data.copy_(self.gather_input([p])[: s.numel].view(s.shape))
            return
        start = 0
        limit = self.allgather_bucket_elems
        if params and params[0].device.type == "cpu":
            limit = min(limit, CPU_GATHER_ELEMS)
        while start < len(params):
            end, elems = start, 0
            while end < len(params) and (end == start or elems < limit):
                elems += self.where[params[end]][1].shard_size * w
                end += 1
            chunk = params[start:end]
            start = end
            inp = self.gather_input(chunk)
            out = self._gather_buffer(inp, w * inp.numel())
            grid = out.view(w, -1)
            if self.local is not None and self.local.gather(comm, chunk, inp, grid, self._stepped):
                pass
            elif self.allgather_partitions:
                what = f"all_gather(updated parameters, {out.numel()} elems)"
                self.collectives.all_gather(comm, out, inp, what).wait()
            else:  # `allgather_partitions: false`: each rank broadcasts its slots
                grid[comm.rank].copy_(inp)
                for r in range(w):
                    what = f"broadcast(updated parameters of rank {r}, {inp.numel()} elems)"
                    comm.broadcast(grid[r], r, what).wait()
            col = 0
            for p in chunk:
                _, s = self.where[p]
                p.data.copy_(from_slots(grid, col, s).view(s.shape))
                col += s.shard_size

    def _gather_buffer(self, inp: torch.Tensor, elems: int) -> torch.Tensor:
        """``elems`` elements to all-gather ``inp`` into: an idle gradient bucket when one is
        large enough (backward is over whenever parameters are gathered here, so the bucket
        memory serves both, as DeepSpeed's flat buffers do), else a buffer of its own, kept
        until :meth:`publish` ends."""
        for reducer in self.reducers.values():
            spare = reducer.spare(inp.dtype, elems)
            if spare is not None and spare.device == inp.device:
                return spare[:elems]
        out = self._gather_out.get(inp.dtype)
        if out is None or out.numel() < elems:
            out = self._gather_out[inp.dtype] = torch.empty(
                elems, dtype=inp.dtype, device=inp.device
            )
        return out[:elems]

    def gather_input(self, chunk: list[nn.Parameter]) -> torch.Tensor:
        """This rank's slots of ``chunk`` in the parameters' dtype, one flat tensor.

        A slice of the master weights when they are adjacent there and already in that
        dtype (fp32 training), a concatenated copy otherwise; at stage 3 with a store that
        wrote the step into the shards, the shards themselves.
        """
        dtype = chunk[0].dtype
        if self.stage3 is not None and self.published(self.where[chunk[0]][0]) is None:
            return torch.cat([self.stage3.shard_of(p) for p in chunk]).to(dtype)
        at = [self.where[p] for p in chunk]
        g0, first = at[0]
        last = at[-1][1]
        adjacent = all(
            g == g0 and s.offset == prev.offset + prev.shard_size
            for (_, prev), (g, s) in itertools.pairwise(at)
        )
        device = chunk[0].device
        src = self._source(g0)
        if adjacent and src.dtype == dtype and src.device == device:
            return src[first.offset : last.offset + last.shard_size]
        # offloaded master weights travel to the parameters' device here
        return torch.cat([self._source(g)[s.offset : s.offset + s.shard_size] for g, s in at]).to(
            device=device, dtype=dtype
        )

    # -- checkpoints and accounting: the store's ---------------------------------------------
    def master_for_save(self) -> list[torch.Tensor]:
        """This rank's fp32 master partition of every group."""
        return self.store.master_for_save()

    def optimizer_state_for_save(self) -> dict[int, dict[str, Any]]:
        """The inner optimizer's per-group state (``state_dict()["state"]``)."""
        return self.store.optimizer_state_for_save()

    def master_for_load(self) -> list[torch.Tensor]:
        """The tensors a checkpoint's master values are copied into (then :meth:`finish_load`)."""
        return self.store.master_for_load()

    def finish_load(self, masters: list[torch.Tensor], state: dict[str, Any] | None) -> None:
        """Adopt loaded master values and, unless ``None``, an optimizer ``state_dict``."""
        self.store.finish_load(masters, state)

    def close(self) -> None:
        """Release what outlives the process group (an offloaded store's swap files)."""
        self.store.close()

    def optimizer_bytes(self) -> int:
        """Memory bytes of the master weights and optimizer state held by this rank."""
        return self.store.optimizer_bytes()

    def grad_bytes(self) -> int:
        """Memory bytes of this rank's gradient partitions."""
        return self.store.grad_bytes()
