"""The optimizer types zcomm adds to zcore's registry (entry points ``zcore.optimizers``):
``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb``, with DeepSpeed's params."""

from __future__ import annotations

from typing import Any

import torch

from zcomm.optim.params import OneBitAdamParams, OneBitLambParams, ZeroOneAdamParams
from zcore.config import OptimizerSpec


def build_onebit_adam(
    groups: list[dict[str, Any]], params: OneBitAdamParams
) -> torch.optim.Optimizer:
    from zcomm.optim.onebit_adam import OneBitAdam

    return OneBitAdam(groups, **params.model_dump())


def build_zero_one_adam(
    groups: list[dict[str, Any]], params: ZeroOneAdamParams
) -> torch.optim.Optimizer:
    from zcomm.optim.zero_one_adam import ZeroOneAdam

    return ZeroOneAdam(groups, **params.model_dump())


def build_onebit_lamb(
    groups: list[dict[str, Any]], params: OneBitLambParams
) -> torch.optim.Optimizer:
    from zcomm.optim.onebit_lamb import OneBitLamb

    return OneBitLamb(groups, **params.model_dump())


ONEBIT_ADAM = OptimizerSpec(
    "OneBitAdam",
    OneBitAdamParams,
    build_onebit_adam,
    reduces_own_gradients=True,
    decoupled_weight_decay=True,
)
ZERO_ONE_ADAM = OptimizerSpec(
    "ZeroOneAdam",
    ZeroOneAdamParams,
    build_zero_one_adam,
    reduces_own_gradients=True,
    decoupled_weight_decay=True,
)
ONEBIT_LAMB = OptimizerSpec(
    "OneBitLamb",
    OneBitLambParams,
    build_onebit_lamb,
    reduces_own_gradients=True,
    decoupled_weight_decay=True,
)
