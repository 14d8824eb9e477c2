"""The pipeline engine: ``zcore.initialize(model=PipelineModule, ...)`` returns it.

One ``train_batch(data_iter)`` reads ``gradient_accumulation_steps`` micro-batches, runs
them through ``torch.distributed.pipelining``'s schedule (the ``pipeline.schedule`` key),
then takes one optimizer step. The engine, not the schedule, owns the accumulation
boundary: the schedule runs inside :meth:`ZEngine.no_sync`, so the gradient hooks (which
1F1B fires once per micro-batch and ZB-V may not fire at all) reduce nothing; after the
last micro-batch the tied layers' gradients are summed across the tie and the step
reduces every parameter's accumulated gradient once (ZeRO 0-3 over ``dp`` within the
stage's ranks). At stage 3 the stage's parameters are gathered once before the schedule
and released after the reduction, before the optimizer steps the shards
(:mod:`zcore.pipe.stage3`: one all-gather per parameter per step; the stage's full
parameters live for the step). The gradient norm and the fp16 overflow flag are summed
over ``pp``, a ``disjoint`` axis (:mod:`zcore.zero.axes`). The gradient partitions are kept
between steps, and where a stage's fp32 master would be a copy of its fp32 parameters (one
slot per parameter: ``dp`` 1 or ZeRO stage 0) the parameters become views of the master
(:meth:`~zcore.zero.store.OptimizerStore.share_params`): no copy to publish; at ``dp`` 1
the schedule also accumulates the gradients straight into the partition
(:mod:`zcore.pipe.grad_views`): no copy to reduce. Stage shapes are static: the first
batch's micro-batch shape is sent once along ``pp`` and every stage infers its activations
on the ``meta`` device (:meth:`PipelineModule.stage_shapes`). A stage that checkpoints its
layers runs a zero-bubble schedule's weight pass as one graph task
(:mod:`zcore.pipe.weight_pass`), so each layer is recomputed once for it.

With ``tp > 1`` (``tensor_parallel.autotp_size``, or a model ``zcore.tensor.parallelize``
cut already) each stage's layers are cut over ``tp`` (:mod:`zcore.pipe.tensor`) and each
``tp`` coordinate runs the schedule over its own ``pp`` group. The norm and the overflow
flag are taken per group axis over ``dp``, ``pp`` and (for cut parameters) ``tp``, so every
stage must hold the same group axes (checked at start); a tie's copies count once in the
norm (:meth:`Ties.norm_overlap`), so clipping holds with ties across stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from zcore.comm import MeshSpec
from zcore.comm.groups import backend_for, init_distributed
from zcore.comm.mesh import spec_from_config
from zcore.config import ZConfig
from zcore.engine import ZEngine
from zcore.pipe.config import PipelineConfig
from zcore.pipe.grad_views import GradViews
from zcore.pipe.model16 import save_pipeline_16bit
from zcore.pipe.module import PipelineModule
from zcore.pipe.schedules import check_layout
from zcore.pipe.stage3 import HeldParameters
from zcore.pipe.ties import Ties
from zcore.pipe.weight_pass import CheckpointedWeightStage
from zcore.zero import GatheredParameters
from zcore.zero.axes import mesh_request

_DTYPES = [torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.float16, torch.bool]


def pipeline_config(config: ZConfig, model: PipelineModule) -> PipelineConfig:
    """The ``pipeline`` block, checked against the model (every disagreement named)."""
    pc = config.extension("pipeline") or PipelineConfig()
    bad = []
    if pc.stages != "auto" and pc.stages != model.num_stages:
        bad.append(f"pipeline.stages {pc.stages} != the model's num_stages {model.num_stages}")
    if pc.partition != "best" and pc.partition != model.partition_method:
        bad.append(
            f"pipeline.partition {pc.partition!r} != the model's partition_method "
            f"{model.partition_method!r}"
        )
    if pc.seed_layers and not model.seed_layers:
        bad.append("pipeline.seed_layers true but the model was built with seed_layers=False")
    ours, theirs = pc.activation_checkpoint_interval, model.activation_checkpoint_interval
    if ours and theirs and ours != theirs:
        bad.append(
            f"pipeline.activation_checkpoint_interval {ours} != the model's "
            f"activation_checkpoint_interval {theirs}"
        )
    if bad:
        raise ValueError("; ".join(bad) + "; make the config agree with the PipelineModule")
    if ours:
        for stage in model.stages:
            stage.interval = ours
    return pc


class PipelineEngine(ZEngine):
    """A :class:`PipelineModule` trained with pipeline parallelism over ``pp`` and ZeRO
    over ``dp`` (see the module docstring). ``forward``/``backward``/``step`` are the
    schedule's; call :meth:`train_batch` and :meth:`eval_batch`."""

    def __init__(
        self,
        model: PipelineModule,
        config: ZConfig,
        optimizer: torch.optim.Optimizer | None = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        mesh: MeshSpec | None = None,
    ) -> None:
        self.pipe = pipeline_config(config, model)
        ep = mesh_request(model).get("ep", 1)
        if ep > 1:
            raise ValueError(
                f"expert parallelism (the model's MoE layers ask for ep_size {ep}) inside "
                "pipeline stages is not built: no equivalence test covers the experts' "
                "all-to-all inside the schedule's micro-batch slots; build the MoE layers "
                "with ep_size 1 (experts replicated, ZeRO cuts them over dp) or train "
                "without pipeline stages"
            )
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        if mesh is None:
            backend = backend_for(device)
            world = (
                torch.distributed.get_world_size()
                if init_distributed(config.comm_timeout_s, backend)
                else 1
            )
            mesh = spec_from_config(config, world, pp=model.num_stages)
        if mesh.pp != model.num_stages:
            raise ValueError(
                f"the mesh has pp {mesh.pp} but the PipelineModule has num_stages "
                f"{model.num_stages}; build the MeshSpec with pp={model.num_stages}"
            )
        super().__init__(model, config, optimizer, model_parameters, lr_scheduler, mesh)
        # Every gradient of a step exists before its one reduction (after the schedule), so
        # stage 0-1's partitions are kept between steps at no extra peak; and a stage whose
        # fp32 master is its parameters (dp 1, or stage 0) steps them in place.
        self.zopt.store.keep_grad_partitions = True
        self.zopt.store.share_params()
        self.grad_views = GradViews(self.zopt)  # .grad as partition views where valid
        tp = self.mesh.spec.tp
        given = self.pipe.model_fields_set & {"pipe_partitioned", "grad_partitioned"}
        if tp > 1 and any(getattr(self.pipe, k) for k in given):
            raise ValueError(
                f"pipeline.{'/'.join(sorted(given))} true: cutting the activations sent "
                f"between stages across tp {tp} is not built; remove the key(s)"
            )
        self.device = device
        self.pp = self.mesh.comm("pp")
        gas = self.batch.gradient_accumulation_steps
        self.kind = check_layout(
            self.pipe.schedule, model.virtual_stages, model.stage_order, self.pp.size, gas
        )
        self._check_group_axes()
        self.held = HeldParameters(self.stage3, model) if self.stage3 is not None else None
        zc = config.zero_optimization
        if self.held is not None and "stage3_max_live_parameters" in zc.model_fields_set:
            self.held.check_limit(self.pp, int(zc.stage3_max_live_parameters), device)
        tied = [p for key in model.tied for p in model.tied_parameters(key)]
        with GatheredParameters(tied):  # stage 3: the ties' full shapes and values
            self.ties = Ties(model, self.pp, self.dtype, device)
            for p in self.ties.sync_initial():
                if self.stage3 is not None and p in self.stage3.params:
                    self.stage3.repartition(p)  # its shard, and the master through the hook
                else:
                    self.zopt.refresh_master(p)
        self._schedule: Any = None
        self._shape: tuple[tuple[int, ...], torch.dtype] | None = None
        self._raw_losses: list[torch.Tensor] = []

    def _check_group_axes(self) -> None:
        """Every pipeline rank reduces the same group axes: the norm and overflow collectives
        run per axis over ``pp``, so a stage without tensor-parallel (or expert) parameters
        beside stages with them would leave the others waiting; refused, naming the stages."""
        kinds = ("tp", "edp")
        have = torch.tensor([int(k in self.zopt.reducers) for k in kinds], dtype=torch.int64)
        low, high = have.clone(), have.clone()
        self.pp.all_reduce(low, "all_reduce(pipeline group axes, min)", dist.ReduceOp.MIN).wait()
        self.pp.all_reduce(high, "all_reduce(pipeline group axes, max)", dist.ReduceOp.MAX).wait()
        odd = [k for k, lo, hi in zip(kinds, low.tolist(), high.tolist(), strict=True) if lo != hi]
        if odd:
            mine = "has" if bool(have[kinds.index(odd[0])]) else "has no"
            raise ValueError(
                f"pipeline stage {self.pp.rank} {mine} {odd[0]}-axis parameters but another "
                f"of the {self.pp.size} stages differs: with tensor parallelism every stage "
                "needs at least one cut layer (give each stage a layer with `tp_cut`, e.g. "
                "change partition_method), and with experts every stage an MoE layer"
            )

    def _gathered(self) -> contextlib.AbstractContextManager[None]:
        """Stage 3: the stage's full parameters inside the block (:mod:`zcore.pipe.stage3`)."""
        return self.held.gathered() if self.held is not None else contextlib.nullcontext()

    def _on_grad(self, p: torch.Tensor) -> None:
        """Nothing per micro-batch: gradients accumulate in ``p.grad`` (reduced once at the
        boundary) and stage-3 parameters stay gathered for the step."""

    # -- what DeepSpeed's PipelineEngine refuses too --------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline engine runs its schedule: call train_batch / eval_batch")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        raise RuntimeError("a pipeline engine runs its schedule: call train_batch / eval_batch")

    # -- batches --------------------------------------------------------------------------
    @property
    def pipe_module(self) -> PipelineModule:
        return self.module  # type: ignore[return-value]

    def _holds(self, stage: int) -> bool:
        return stage in self.pipe_module.local_stages

    def _read(self, data_iter: Iterator[Any] | None) -> tuple[list[Any], list[Any]]:
        """``gradient_accumulation_steps`` micro-batches ``(inputs, labels)`` (first and
        last stages only: the others need no data)."""
        model = self.pipe_module
        need = self._holds(0) or self._holds(model.total_stages - 1)
        if not need:
            return [], []
        if data_iter is None:
            raise ValueError(
                f"pipeline rank {self.pp.rank} holds the first or last stage and needs "
                "data: pass train_batch(data_iter) yielding (inputs, labels) micro-batches"
            )
        xs, ys = [], []
        for _ in range(self.batch.gradient_accumulation_steps):
            x, y = next(data_iter)
            xs.append(self._cast_input(x.to(self.device)))
            ys.append(y.to(self.device))
        return xs, ys

    def _agree_shape(self, xs: list[torch.Tensor]) -> tuple[tuple[int, ...], torch.dtype]:
        """The micro-batch input shape, sent along ``pp`` from the first stage's rank."""
        meta = torch.zeros(10, dtype=torch.int64, device=self.device)
        if self._holds(0):
            x = xs[0]
            if x.dim() > 8:
                raise ValueError(f"pipeline inputs have at most 8 dimensions, got {x.dim()}")
            meta[0], meta[1] = x.dim(), _DTYPES.index(x.dtype)
            meta[2 : 2 + x.dim()] = torch.tensor(x.shape)
        self.pp.broadcast(meta, 0, "broadcast(pipeline input shape)").wait()
        meta = meta.cpu()
        shape = tuple(int(v) for v in meta[2 : 2 + int(meta[0])])
        return shape, _DTYPES[int(meta[1])]

    def _build_schedule(self, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        model = self.pipe_module
        acts = model.stage_shapes(torch.empty(shape, dtype=dtype, device="meta"), self.dtype)
        group = self.mesh.group("pp")
        stages = [
            (CheckpointedWeightStage if s.interval > 0 else PipelineStage)(
                s,
                s.index,
                model.total_stages,
                self.device,
                input_args=acts[s.index],
                output_args=acts[s.index + 1],
                group=group,
            )
            for s in model.stages
        ]
        loss = self._loss if model.loss_fn is not None else None
        gas = self.batch.gradient_accumulation_steps
        if self.kind.multi:
            return self.kind.cls(stages, gas, loss_fn=loss, scale_grads=False)
        return self.kind.cls(stages[0], gas, loss_fn=loss, scale_grads=False)

    def _schedule_for(self, xs: list[torch.Tensor]) -> Any:
        shape = self._agree_shape(xs)
        if self._shape is not None and shape != self._shape:
            raise ValueError(
                f"micro-batch inputs changed from {list(self._shape[0])} {self._shape[1]} to "
                f"{list(shape[0])} {shape[1]}; pipeline stages have static shapes: keep "
                "every micro-batch the same shape (pad or drop the last batch)"
            )
        if self._schedule is None:
            self._shape = shape
            self._schedule = self._build_schedule(*shape)
        return self._schedule

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.pipe_module.loss_fn(output, target)  # type: ignore[misc]
        self._raw_losses.append(loss.detach().float())
        scale = self.scaler.scale if self.scaler is not None else 1.0
        return loss * (scale / self.batch.gradient_accumulation_steps)

    def _mean_loss(self) -> torch.Tensor:
        """The mean loss over the micro-batches and data-parallel ranks, on every rank."""
        model = self.pipe_module
        last = model.total_stages - 1
        holder = last % self.pp.size if model.stage_order == "loop" else 0
        out = torch.zeros((), dtype=torch.float32, device=self.device)
        if self._raw_losses:
            out = torch.stack(self._raw_losses).mean().to(self.device)
        self._raw_losses = []
        self.pp.broadcast(out, holder, "broadcast(pipeline loss)").wait()
        for comm in (self.comm, self.replicas):
            if comm.size > 1:
                comm.all_reduce(out, "all_reduce(pipeline loss)").wait()
                out /= comm.size
        return out

    def _run(self, xs: list[Any], ys: list[Any], train: bool) -> None:
        if self.pp.size == 1:
            self._run_local(xs, ys, train)
            return
        schedule = self._schedule_for(xs)
        args = dict(
            arg_mbs=[(x,) for x in xs] if self._holds(0) else None,
            target_mbs=ys if self._holds(self.pipe_module.total_stages - 1) else None,
        )
        if train:
            schedule.step(**args, return_outputs=False)
        else:
            schedule.eval(**args)

    def _run_local(self, xs: list[Any], ys: list[Any], train: bool) -> None:
        """pp 1 (``dp`` may span many ranks): every stage is this rank's, so the micro-batches
        run through them in order with the schedule's loss scaling and no sends (torch's
        ``PipelineStage`` takes a group of ``pp`` ranks and has none to take here)."""
        stages = sorted(self.pipe_module.stages, key=lambda s: s.index)
        if self.pipe_module.loss_fn is None:
            if train:
                raise ValueError("train_batch needs the PipelineModule's loss_fn")
            return
        for x, y in zip(xs, ys, strict=True):
            out = x
            for stage in stages:
                out = stage(out)
            loss = self._loss(out, y)
            if train:
                loss.backward()

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns
        the mean loss (on every rank, as DeepSpeed does)."""
        self.module.train()
        xs, ys = self._read(data_iter)
        gas = self.batch.gradient_accumulation_steps
        self.mesh.set_step(self.global_steps)
        self._sync = False  # the gradient hooks leave p.grad alone: reduced once, below
        with self._gathered():  # stage 3: gathered once for every micro-batch
            self.grad_views.lend()
            with self.no_sync():
                self._run(xs, ys, train=True)
            self.ties.reduce_grads()
            if self.ties.crosses_ranks:  # each holder's copy counts once in the norm
                overlap = self.ties.norm_overlap([self.comm, self.replicas], self.stage)
                self.zopt.norm_overlap = overlap
            self.grad_views.take_back()
            if self.held is not None:  # reduce-scatter now, so the step runs released
                self.zopt.reduce_leftovers()
        self.micro_steps += gas - 1
        self.global_samples += self.batch.micro_batch_size * self.world_size * (gas - 1)
        ZEngine.step(self)  # the boundary: reduce every gradient once, then step
        return self._mean_loss()

    def eval_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """The mean loss over ``gradient_accumulation_steps`` micro-batches, no update.

        Not under ZB-V: torch's ``ScheduleZBVZeroBubble.eval`` still runs the backward
        hand-over between a rank's two stages and fails; refused up front instead."""
        if self.kind.name == "zbv":
            raise ValueError(
                "eval_batch under pipeline.schedule 'zbv' is not built: torch's ZB-V "
                "schedule cannot run forward-only; evaluate with a 1f1b/interleaved_1f1b "
                "engine (the same checkpoint loads there, at any stage layout)"
            )
        self.module.eval()
        xs, ys = self._read(data_iter)
        with torch.no_grad(), self._gathered():
            self._run(xs, ys, train=False)
        return self._mean_loss()

    def step(self) -> None:
        raise RuntimeError("a pipeline engine steps inside train_batch; call train_batch")

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Rank 0 writes every stage's layers as one plain ``state_dict`` (collective;
        :mod:`zcore.pipe.model16`). Not with ``tp > 1``: the stages hold tensor-parallel
        shards there; save a checkpoint and ``consolidate`` it."""
        zc = self.config.zero_optimization
        if self.pp.size == 1 or (
            self.stage == 3 and not zc.stage3_gather_16bit_weights_on_model_save
        ):
            return super().save_16bit_model(save_dir, save_filename)  # or its refusal
        if self.mesh.spec.tp > 1:
            raise ValueError(
                f"save_16bit_model at pp {self.pp.size} x tp {self.mesh.spec.tp}: the stages "
                "hold tensor-parallel shards; use save_checkpoint and then "
                "zcore.checkpoint.consolidate (or `z checkpoint consolidate`) for full tensors"
            )
        writer = self.comm.rank == 0 and self.replicas.rank == 0
        parts = self.checkpoint_parts()
        return save_pipeline_16bit(parts, self.pp, writer, save_dir, save_filename)
