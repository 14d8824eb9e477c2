"""Tensor parallelism under :class:`zcore.hf.Trainer` (``tensor_parallel.autotp_size`` T > 1).

DeepSpeed's AutoTP training is switched on the same way: the ds_config's
``"tensor_parallel": {"autotp_size": T}`` and transformers' Trainer. Here the model is cut by
the tensor-parallel plan its config chooses (:func:`zcore.tensor.parallelize`; the ``llama``
plan for LLaMA/Mistral/Qwen2) and every rank of a ``tp`` group trains on the same batches:

- :func:`cut_model` cuts the model over the job mesh's ``tp`` axis before the Trainer makes
  its optimizer, so the optimizer holds the shards (``zcore.initialize`` then finds the model
  cut and uses the same mesh);
- :func:`share_batches_over_tp` makes accelerate's data loaders shard the data over the data
  ranks only: the mesh puts ``tp`` innermost, so global ranks ``[d T, (d + 1) T)`` are data
  rank ``d`` and read its batches (accelerate does the same for DeepSpeed's AutoTP mesh);
- the Trainer reports ``T`` as its ``get_tp_size()``, which transformers divides out of the
  token count it sums over every process and of the loss scale, so each rank's loss is its
  data rank's share of the global mean and the engine's average over ``dp`` is that mean.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def cut_model(model: nn.Module, config: dict[str, Any]) -> None:
    """Cut ``model`` over the mesh ``config`` describes (nothing when it is cut already or
    ``config`` asks for no ``tp``); a model that cannot be cut raises ``ValueError`` naming
    every size ``tp`` does not divide."""
    from zcore.comm import mesh_for_config
    from zcore.config import ZConfig
    from zcore.tensor.parallelize import parallelize_for_config

    cfg = ZConfig.load(config)
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    parallelize_for_config(model, cfg, mesh_for_config(cfg, device))


def share_batches_over_tp(accelerator: Any, tp: int) -> None:
    """Make ``accelerator.prepare`` give the ``tp`` consecutive ranks of each data rank the
    same batches: its data loaders are sharded over ``num_processes / tp`` data ranks."""
    from accelerate.data_loader import prepare_data_loader

    def prepare(
        loader: torch.utils.data.DataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        if getattr(loader, "_is_accelerate_prepared", False):
            if loader not in accelerator._dataloaders:
                accelerator._dataloaders.append(loader)
            return loader
        prepared = prepare_data_loader(
            loader,
            accelerator.device,
            num_processes=accelerator.num_processes // tp,
            process_index=accelerator.process_index // tp,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement
            if device_placement is None
            else device_placement,
            rng_types=accelerator.rng_types.copy(),
            dispatch_batches=accelerator.dispatch_batches,
            even_batches=accelerator.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        accelerator._dataloaders.append(prepared)
        return prepared

    accelerator.prepare_data_loader = prepare
