"""Adam and AdamW with the step in the native core."""

from __future__ import annotations

from typing import Any

import torch

import znative
from zcore.optim._base import NativeOptimizer, ParamsT, check_adam_group
from zcore.optim._buffers import view


class CPUAdam(NativeOptimizer):
    """``torch.optim.Adam`` for fp32 CPU parameters, stepped by a multi-threaded SIMD kernel.

    Same arguments, defaults and ``state_dict()`` content as ``torch.optim.Adam``
    (``decoupled_weight_decay=True`` gives AdamW), plus:

    Args:
        bias_correction: divide the moments by ``1 - beta^t`` (as torch does); turn
            off to match optimizers that skip it.
        state_dtype: dtype of ``exp_avg`` / ``exp_avg_sq``. ``torch.bfloat16``
            halves their memory and cuts the bytes moved per parameter from 28 to 20.
    """

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
        bias_correction: bool = True,
        state_dtype: torch.dtype = torch.float32,
    ):
        if amsgrad:
            raise ValueError(
                "amsgrad=True is not supported by CPUAdam; use torch.optim.Adam(amsgrad=True)"
            )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults, state_dtype)

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        check_adam_group(group, where, "CPUAdam")

    def _kernel(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        step: int,
    ) -> None:
        beta1, beta2 = group["betas"]
        znative.adam_step(
            view(p),
            view(grad),
            view(state["exp_avg"]),
            view(state["exp_avg_sq"]),
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            step=step,
            adamw=bool(group["decoupled_weight_decay"]),
            bias_correction=bool(group["bias_correction"]),
            maximize=bool(group["maximize"]),
        )


class CPUAdamW(CPUAdam):
    """``torch.optim.AdamW`` for fp32 CPU parameters: :class:`CPUAdam` with decoupled
    weight decay and AdamW's default ``weight_decay=1e-2``."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        bias_correction: bool = True,
        state_dtype: torch.dtype = torch.float32,
    ):
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            decoupled_weight_decay=True,
            bias_correction=bias_correction,
            state_dtype=state_dtype,
        )
