"""One optimizer step on explicit tensors, for callers that manage their own
state (ZeRO-Offload steps a flat fp32 partition with bf16 gradients copied
off the device). Gradients and states may be float32 or bfloat16; the
parameter is fp32. Everything is checked before anything is written."""

from __future__ import annotations

import torch

import znative
from zcore.optim._buffers import check_like, check_param, view

kernel_view = view
"""A numpy array sharing a CPU tensor's memory as the native kernels take it (float32 as
is, bfloat16 as its int16 bits): for callers that drive :mod:`znative` kernels directly."""


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
    bias_correction: bool = True,
    maximize: bool = False,
) -> None:
    """Adam/AdamW step ``step`` (1-based) on ``param`` in place."""
    check_param(param, "param")
    check_like(grad, param, "grad", "adam_step")
    check_like(exp_avg, param, "exp_avg", "adam_step")
    check_like(exp_avg_sq, param, "exp_avg_sq", "adam_step")
    znative.adam_step(
        view(param),
        view(grad),
        view(exp_avg),
        view(exp_avg_sq),
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        adamw=decoupled_weight_decay,
        bias_correction=bias_correction,
        maximize=maximize,
    )


def adagrad_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    state_sum: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-2,
    lr_decay: float = 0.0,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> None:
    """Adagrad step ``step`` (1-based) on ``param`` in place."""
    check_param(param, "param")
    check_like(grad, param, "grad", "adagrad_step")
    check_like(state_sum, param, "state_sum", "adagrad_step")
    znative.adagrad_step(
        view(param),
        view(grad),
        view(state_sum),
        lr=lr,
        lr_decay=lr_decay,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        maximize=maximize,
    )


def lion_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> None:
    """Lion step on ``param`` in place (``step`` is checked, Lion has no bias correction)."""
    check_param(param, "param")
    check_like(grad, param, "grad", "lion_step")
    check_like(exp_avg, param, "exp_avg", "lion_step")
    znative.lion_step(
        view(param),
        view(grad),
        view(exp_avg),
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=weight_decay,
        step=step,
        maximize=maximize,
    )
