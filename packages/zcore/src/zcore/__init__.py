"""zcore: the zstack training engine.

``zcore.initialize`` wraps a PyTorch model for ZeRO data-parallel training (stages 0-3,
fp32/bf16/fp16, gradient accumulation and clipping) with the same call shape as
``deepspeed.initialize``, so porting a DeepSpeed loop is an import change. The config is
DeepSpeed's JSON (:mod:`zcore.config`); checkpoints are sharded, atomic and load on any
world size (:mod:`zcore.checkpoint`); :mod:`zcore.optim` holds the native CPU optimizers.

The public submodules load on first use, as DeepSpeed's do after ``import deepspeed``:
``import zcore`` then ``zcore.zero.Init()`` works, and ``import zcore`` itself imports
neither torch nor the engine.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what __getattr__ gives, for type checkers
    from zcore import checkpoint as checkpoint
    from zcore import comm as comm
    from zcore import config as config
    from zcore import engine as engine
    from zcore import lr_schedules as lr_schedules
    from zcore import memory as memory
    from zcore import monitor as monitor
    from zcore import optim as optim
    from zcore import precision as precision
    from zcore import tensor as tensor
    from zcore import zero as zero

__version__ = "0.1.0"

#: Submodules reachable as attributes of ``zcore`` without importing them first.
_SUBMODULES = frozenset(
    {
        "checkpoint",
        "comm",
        "config",
        "engine",
        "lr_schedules",
        "memory",
        "monitor",
        "optim",
        "pipe",
        "precision",
        "tensor",
        "zero",
    }
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"zcore.{name}")  # also binds it on this module
    raise AttributeError(f"module 'zcore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})


def initialize(
    model: Any,
    optimizer: Any = None,
    model_parameters: Any = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
    config: dict | str | os.PathLike | None = None,
    collate_fn: Any = None,
    config_params: dict | None = None,
    mesh: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """Wrap ``model`` for ZeRO training (a ``zcore.pipe.PipelineModule``: pipeline
    parallelism too, :mod:`zcore.pipe`); returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    Args:
        model: the ``torch.nn.Module`` to train (at stage 3 it may come from ``zcore.zero.Init``).
        optimizer: a ``torch.optim`` optimizer over the model's parameters, or ``None`` to
            build the config's ``optimizer`` block. Element-wise optimizers only (see
            :mod:`zcore.optim.factory`).
        model_parameters: parameters or param groups for the config-built optimizer.
        lr_scheduler: an ``LRScheduler`` or a callable ``optimizer -> scheduler``; ``None``
            builds the config's ``scheduler`` block if any.
        training_data: a ``torch.utils.data.Dataset``; a distributed loader with the
            config's micro-batch size is returned for it.
        config: DeepSpeed-style config: a dict or the path of a JSON file.
        mesh: a :class:`zcore.comm.MeshSpec` sizing every mesh axis, for axes the config
            does not size (``pp``, ``tp``); default: the mesh the config describes.
    """
    from zcore.config import ZConfig
    from zcore.engine import ZEngine

    if config is None:
        config = config_params
    if config is None:
        raise ValueError("zcore.initialize needs config= (a dict or the path of a JSON file)")
    cfg = ZConfig.load(config)
    from zcore.pipe.module import PipelineModule

    engine_cls: Any = ZEngine
    if isinstance(model, PipelineModule):
        from zcore.pipe.engine import PipelineEngine

        engine_cls = PipelineEngine
    engine = engine_cls(model, cfg, optimizer, model_parameters, lr_scheduler, mesh)
    loader = None
    if training_data is not None:
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(
            training_data, num_replicas=engine.world_size, rank=engine.data_rank, shuffle=True
        )
        loader = DataLoader(
            training_data,
            batch_size=engine.batch.micro_batch_size,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=True,
        )
    return engine, engine.optimizer, loader, engine.lr_scheduler


__all__ = ["initialize"]
