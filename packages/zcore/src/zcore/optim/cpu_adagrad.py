"""Adagrad with the step in the native core."""

from __future__ import annotations

from typing import Any

import torch

import znative
from zcore.optim._base import NativeOptimizer, ParamsT, check_range
from zcore.optim._buffers import view


class CPUAdagrad(NativeOptimizer):
    """``torch.optim.Adagrad`` for fp32 CPU parameters, stepped by the native kernel.

    Same arguments, defaults and ``state_dict()`` content (state key ``sum``) as
    ``torch.optim.Adagrad``; ``state_dtype=torch.bfloat16`` stores ``sum`` in bf16.
    """

    state_keys = ("sum",)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        state_dtype: torch.dtype = torch.float32,
    ):
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            eps=eps,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            maximize=maximize,
        )
        super().__init__(params, defaults, state_dtype)

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        check_range(where, "lr", float(group["lr"]), 0.0)
        check_range(where, "lr_decay", float(group["lr_decay"]), 0.0)
        check_range(where, "eps", float(group["eps"]), 0.0)
        check_range(where, "weight_decay", float(group["weight_decay"]), 0.0)
        check_range(
            where, "initial_accumulator_value", float(group["initial_accumulator_value"]), 0.0
        )

    def initial_state_value(self, key: str, group: dict[str, Any]) -> float:
        return float(group["initial_accumulator_value"])

    def _kernel(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        step: int,
    ) -> None:
        znative.adagrad_step(
            view(p),
            view(grad),
            view(state["sum"]),
            lr=float(group["lr"]),
            lr_decay=float(group["lr_decay"]),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            step=step,
            maximize=bool(group["maximize"]),
        )
