"""Lion with the step in the native core."""

from __future__ import annotations

from typing import Any

import torch

import znative
from zcore.optim._base import NativeOptimizer, ParamsT, check_range
from zcore.optim._buffers import view


class CPULion(NativeOptimizer):
    """Lion (Chen et al., 2023) for fp32 CPU parameters.

    ``update = sign(beta1 * m + (1 - beta1) * g)``;
    ``p = p * (1 - lr * weight_decay) - lr * update``;
    ``m = beta2 * m + (1 - beta2) * g``. State key ``exp_avg``.
    Lion wants a learning rate 3-10x smaller than AdamW's and a larger weight decay.
    """

    state_keys = ("exp_avg",)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        state_dtype: torch.dtype = torch.float32,
    ):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, state_dtype)

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        check_range(where, "lr", float(group["lr"]), 0.0)
        check_range(where, "weight_decay", float(group["weight_decay"]), 0.0)
        beta1, beta2 = group["betas"]
        check_range(where, "betas[0]", float(beta1), 0.0, 1.0)
        check_range(where, "betas[1]", float(beta2), 0.0, 1.0)

    def _kernel(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        step: int,
    ) -> None:
        beta1, beta2 = group["betas"]
        znative.lion_step(
            view(p),
            view(grad),
            view(state["exp_avg"]),
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(group["weight_decay"]),
            step=step,
            maximize=bool(group["maximize"]),
        )
