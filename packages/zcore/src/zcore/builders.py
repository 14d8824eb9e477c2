"""Builders that turn a config and a model into the engine's parts.

:class:`~zcore.engine.ZEngine` wires what these return (as torchtitan's ``train.py`` wires
parts made by small builders): the model's parameters placed on the mesh
(:func:`place_parameters`: broadcast from the first data-parallel rank, cast, and at stage 3
cut into shards), the optimizer param groups (:func:`param_groups`) and the ZeRO optimizer
with its store, collectives and inner optimizer (:func:`build_zero_optimizer`). A new
parallelism adds a builder here and a part to the engine, not branches to the training step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zcore.config import ZConfig
from zcore.optim.factory import build_inner_optimizer
from zcore.zero.axes import GroupAxis, param_axis, set_cut, split_groups
from zcore.zero.backends import optimizer_backend, param_backend
from zcore.zero.collectives import Collectives
from zcore.zero.communicating import bind_inner
from zcore.zero.optimizer import ZeroOptimizer
from zcore.zero.stage3 import ShardStore, Stage3Params

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def unique_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``named_parameters()`` with tied parameters listed once (first name wins)."""
    seen: set[int] = set()
    out = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def broadcast_initial(axes: dict[str, GroupAxis], tensors: list[torch.Tensor], axis: str) -> None:
    """Start every rank from the values of the first rank of ``axis`` (as
    DistributedDataParallel does; experts: the first rank holding the same experts)."""
    for t in tensors:
        if t.numel():
            axes[axis].broadcast_from_first(t, "broadcast(initial parameters)")


def cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    for m in module.modules():
        for k, b in m.named_buffers(recurse=False):
            if b is not None and b.is_floating_point():
                setattr(m, k, b.to(dtype))


def place_parameters(
    model: nn.Module,
    config: ZConfig,
    named: list[tuple[str, nn.Parameter]],
    axes: dict[str, GroupAxis],
    collectives: Collectives,
    dtype: torch.dtype,
    ep: int,
) -> Stage3Params | None:
    """Give every rank the first data-parallel rank's parameters and buffers in ``dtype``;
    at stage 3 cut each parameter into shards over its axis and return their owner."""
    zc = config.zero_optimization
    for _, p in named:  # what GatheredParameters(modifier_rank=r) broadcasts over
        set_cut(p, axes[param_axis(p)])
    if zc.stage != 3:
        model.to(dtype)
        for axis in axes:
            broadcast_initial(axes, [p.data for _, p in named if param_axis(p) == axis], axis)
        broadcast_initial(axes, list(model.buffers()), "dp")
        return None
    stage3 = getattr(model, "_z_stage3", None) or Stage3Params(
        axes["dp"].shard, persistence_threshold=int(zc.stage3_param_persistence_threshold)
    )
    # also when zero.Init built it: its fetch policy comes from this config
    stage3.prefetch_elems = int(zc.stage3_prefetch_bucket_size)
    stage3.max_live_elems = int(zc.stage3_max_live_parameters)
    stage3.max_reuse_elems = int(zc.stage3_max_reuse_distance)
    stage3.axis_comms = {a: ax.shard for a, ax in axes.items()}
    for n, p in named:
        if p not in stage3.params:  # zero.Init broadcast its own already
            broadcast_initial(axes, [p.data], param_axis(p))
            stage3.partition(p, n)
        elif param_axis(p) != "dp" and ep > 1:
            raise ValueError(
                f"expert parameter `{n}` was partitioned by zero.Init over every "
                "data-parallel rank, but experts are cut across the expert-data-"
                f"parallel ranks (ep {ep}); build MoE layers outside "
                "zero.Init (each rank builds only its own experts)"
            )
    stage3.collectives = collectives
    stage3.cast_(dtype)
    off_param = zc.offload_param
    offloading = off_param is not None and off_param.device != "none"
    if offloading and type(stage3.store) is ShardStore:  # not by zero.Init already
        stage3.store = param_backend(off_param.device)(config, stage3)
    cast_buffers(model, dtype)
    broadcast_initial(axes, list(model.buffers()), "dp")
    stage3.install(model)
    return stage3


def param_groups(
    named: list[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer | None,
    model_parameters: Any,
) -> list[dict[str, Any]]:
    """The optimizer's param groups (from ``optimizer``, ``model_parameters`` or every
    trainable parameter), trainable parameters only, split by axis (experts last)."""
    known = {id(p) for _, p in named}
    if optimizer is not None:
        raw = optimizer.param_groups
    elif model_parameters is not None:
        mp = list(model_parameters)
        raw = mp if mp and isinstance(mp[0], dict) else [{"params": mp}]
    else:
        raw = [{"params": [p for _, p in named if p.requires_grad]}]
    groups = []
    for g in raw:
        params = [p for p in g["params"] if p.requires_grad]
        stray = [p for p in params if id(p) not in known]
        if stray:
            raise ValueError(
                f"{len(stray)} optimizer parameter(s) are not parameters of the model; "
                "build the optimizer from `model.parameters()`"
            )
        groups.append({**g, "params": params})
    return split_groups(groups)


def _backend(axes: dict[str, GroupAxis]) -> str:
    group = axes["dp"].shard.group
    return "none" if group is None else str(torch.distributed.get_backend(group))


def build_zero_optimizer(
    config: ZConfig,
    groups: list[dict[str, Any]],
    names: dict[nn.Parameter, str],
    axes: dict[str, GroupAxis],
    optimizer: torch.optim.Optimizer | None,
    dtype: torch.dtype,
    stage3: Stage3Params | None,
    collectives: Collectives,
) -> ZeroOptimizer:
    """The ZeRO optimizer the config describes: its store (``offload_optimizer.device``),
    reduction settings and inner optimizer (bound to the ranks when it communicates)."""
    zc = config.zero_optimization
    accum = config.data_types.grad_accum_dtype
    comm_dtype = config.communication_data_type
    offload = zc.offload_optimizer
    store = optimizer_backend(offload.device if offload else "none")(config)
    dense = axes["dp"]
    zopt = ZeroOptimizer(
        groups,
        names,
        zc.stage,
        dense.shard,
        build_inner_optimizer(config, optimizer, dtype),
        stage3=stage3,
        grad_accum_dtype=DTYPES[accum] if accum else dtype,
        comm_dtype=DTYPES[comm_dtype] if comm_dtype else None,
        reduce_bucket_elems=int(zc.reduce_bucket_size),
        allgather_bucket_elems=int(zc.allgather_bucket_size),
        overlap_comm=zc.effective_overlap_comm,
        # gloo's reduce_scatter is about 2x slower than its all_reduce of the same bucket,
        # so on gloo the bucket is all-reduced and each rank keeps its row, as
        # `reduce_scatter: false` does.
        reduce_scatter=zc.reduce_scatter
        and (_backend(axes) != "gloo" or collectives.scatter_layout),
        # DeepSpeed's ZeRO divides by the world size before summing; with
        # `prescale_gradients` by `gradient_predivide_factor`, the rest after.
        predivide=config.gradient_predivide_factor if config.prescale_gradients else None,
        allgather_partitions=zc.allgather_partitions,
        replicas=dense.replicas,
        collectives=collectives,
        store=store,
        axes=axes,
    )
    type_name = config.optimizer.type if config.optimizer else type(optimizer).__name__
    replicas = dense.replicas.size if dense.replicas is not None else 1
    bind_inner(zopt, dense.shard, replicas=replicas, type_name=type_name)
    return zopt
