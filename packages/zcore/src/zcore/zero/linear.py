"""A linear layer whose backward keeps the weight *parameter*, not a view of its data.

``torch.nn.functional.linear`` saves ``weight.t()`` for backward: a view that shares the
weight's storage. At stage 3 that view keeps every gathered weight alive from forward to
backward, although the parameter's ``.data`` was released, so a model's full weights
pile up during forward. :class:`ZeroLinearFunction` saves the parameter itself: releasing
its ``.data`` frees the storage, and stage 3 gathers it again before the module's
backward, which the saved parameter then sees. (DeepSpeed does the same with its
``LinearFunctionForZeroStage3``.) Stage 3 installs it on ``nn.Linear`` modules whose weight
is partitioned.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ZeroLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        ctx.save_for_backward(x, weight, bias)
        out = x.matmul(weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight, bias = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight)
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = flat.t().matmul(x.reshape(-1, x.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = flat.sum(0)
        return grad_x, grad_w, grad_b


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return ZeroLinearFunction.apply(x, self.weight, self.bias)


def install(module: nn.Linear) -> None:
    """Route ``module``'s forward through :class:`ZeroLinearFunction`."""
    module.forward = _forward.__get__(module)  # type: ignore[method-assign]


def uninstall(module: nn.Linear) -> None:
    module.__dict__.pop("forward", None)
