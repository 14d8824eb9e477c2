"""The optimizer that steps each rank's fp32 master partition.

From the config's ``optimizer`` block (Adam, AdamW, SGD, Adagrad, Lion; on CPU the
native :mod:`zcore.optim` kernels) or from a ``torch.optim`` optimizer the user built
over the model, re-created with the same class and per-group hyperparameters over the
flat master tensors. Only element-wise optimizers give the same result partitioned as
whole (all the built-in ones are); an optimizer that mixes elements across a tensor
(LBFGS, Shampoo-like ones) would see flat slices instead of the original shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zcore.config import ZConfig
from zcore.optim import CPUAdagrad, CPUAdam, CPULion

Factory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


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
    kind = config.optimizer.type
    params = config.optimizer.params
    kwargs = params.model_dump()

    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        cpu = all(g["params"][0].device.type == "cpu" for g in groups if g["params"])
        if kind in ("Adam", "AdamW"):
            decoupled = kind == "AdamW" or bool(getattr(params, "adam_w_mode", False))
            if cpu:
                return CPUAdam(groups, **kwargs, decoupled_weight_decay=decoupled)
            cls = torch.optim.AdamW if decoupled else torch.optim.Adam
            return cls(groups, **kwargs, fused=True)
        if kind == "Adagrad":
            return CPUAdagrad(groups, **kwargs) if cpu else torch.optim.Adagrad(groups, **kwargs)
        if kind == "Lion":
            if not cpu:
                raise ValueError("Lion runs on CPU master weights only (offload the optimizer)")
            return CPULion(groups, **kwargs)
        if kind == "SGD":
            return torch.optim.SGD(groups, **kwargs)
        raise ValueError(f"optimizer.type {kind!r} is not supported")

    return build


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
