"""The optimizer that steps each rank's fp32 master partition.

From the config's ``optimizer`` block, through the type's registered factory
(:mod:`zcore.config.optim_registry`; zcore's own types are built here: Adam, AdamW,
SGD, Adagrad, Lion, on CPU with the native :mod:`zcore.optim` kernels), or from a
``torch.optim`` optimizer the user built over the model, re-created with the same class
and per-group hyperparameters over the flat master tensors. Only element-wise optimizers
give the same result partitioned as whole (all the built-in ones are); an optimizer that
mixes elements across a tensor (LBFGS, Shampoo-like ones) would see flat slices instead
of the original shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zcore.config import AdagradParams, AdamParams, LionParams, SGDParams, ZConfig
from zcore.optim.cpu_adagrad import CPUAdagrad
from zcore.optim.cpu_adam import CPUAdam
from zcore.optim.cpu_lion import CPULion

Factory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
Groups = list[dict[str, Any]]


def build_inner_optimizer(
    config: ZConfig, client: torch.optim.Optimizer | None, dtype: torch.dtype
) -> Factory:
    """A function that builds the inner optimizer over master-partition param groups."""
    if client is not None:
        return _from_client(client)
    if config.optimizer is None:
        raise ValueError(
            "no optimizer: pass `optimizer=` to zcore.initialize or add an "
            '`"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}` block to the config'
        )
    build = config.optimizer.spec.factory()
    params = config.optimizer.params
    return lambda groups: build(groups, params)


def _on_cpu(groups: Groups) -> bool:
    return all(g["params"][0].device.type == "cpu" for g in groups if g["params"])


def _adam(groups: Groups, params: AdamParams, decoupled: bool) -> torch.optim.Optimizer:
    kwargs = params.model_dump()
    if _on_cpu(groups):
        return CPUAdam(groups, **kwargs, decoupled_weight_decay=decoupled)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(groups, **kwargs, fused=True)


def build_adam(groups: Groups, params: AdamParams) -> torch.optim.Optimizer:
    """``Adam``: AdamW unless ``adam_w_mode`` is false (DeepSpeed's rule)."""
    return _adam(groups, params, params.adam_w_mode)


def build_adamw(groups: Groups, params: AdamParams) -> torch.optim.Optimizer:
    """``AdamW``: decoupled weight decay whatever ``adam_w_mode`` says."""
    return _adam(groups, params, True)


def build_sgd(groups: Groups, params: SGDParams) -> torch.optim.Optimizer:
    """``SGD``: torch's."""
    return torch.optim.SGD(groups, **params.model_dump())


def build_adagrad(groups: Groups, params: AdagradParams) -> torch.optim.Optimizer:
    """``Adagrad``: the native kernel on CPU, torch's elsewhere."""
    kwargs = params.model_dump()
    return (
        CPUAdagrad(groups, **kwargs) if _on_cpu(groups) else torch.optim.Adagrad(groups, **kwargs)
    )


def build_lion(groups: Groups, params: LionParams) -> torch.optim.Optimizer:
    """``Lion``: the native kernel; CPU master weights only."""
    if not _on_cpu(groups):
        raise ValueError("Lion runs on CPU master weights only (offload the optimizer)")
    return CPULion(groups, **params.model_dump())


def _from_client(client: torch.optim.Optimizer) -> Factory:
    if client.state:
        raise ValueError(
            "the optimizer passed to zcore.initialize already has state; pass a fresh one "
            "(load optimizer state through engine.load_checkpoint)"
        )
    cls = type(client)
    defaults = dict(client.defaults)
    extra = {"state_dtype": client.state_dtype} if hasattr(client, "state_dtype") else {}

    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        try:
            return cls(groups, **defaults, **extra)
        except TypeError:
            return cls(groups, **extra)

    return build
