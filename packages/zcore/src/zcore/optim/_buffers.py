"""Turning CPU tensors into the zero-copy numpy views the native kernels take.

Every check here runs before any kernel is called, so a step that is going to
fail fails before it has changed a single parameter.
"""

from __future__ import annotations

from typing import Any

import torch

#: dtypes the kernels accept for gradients and optimizer states.
STATE_DTYPES = (torch.float32, torch.bfloat16)


def check_param(p: torch.Tensor, where: str) -> None:
    """Raise if `p` cannot be a parameter of a native CPU optimizer."""
    if p.device.type != "cpu":
        raise TypeError(
            f"{where}: parameter is on {p.device}, but this optimizer runs on the CPU; "
            "keep fp32 master parameters on the CPU (or use a GPU optimizer such as "
            "`torch.optim.AdamW(fused=True)` for device parameters)"
        )
    if p.dtype != torch.float32:
        raise TypeError(
            f"{where}: parameter dtype is {p.dtype}; native CPU optimizers update fp32 master "
            "parameters; keep an fp32 copy and cast after the step"
        )
    if not p.is_contiguous():
        raise ValueError(
            f"{where}: parameter with shape {tuple(p.shape)} and strides {p.stride()} is not "
            "contiguous; the step updates memory in place, so pass `.contiguous()` tensors"
        )


def check_like(t: torch.Tensor, p: torch.Tensor, name: str, where: str) -> None:
    """Raise unless `t` (a gradient or state) can be updated alongside parameter `p`."""
    if t.is_sparse:
        raise TypeError(f"{where}: {name} is sparse; native CPU optimizers take dense gradients")
    if t.device.type != "cpu":
        raise TypeError(f"{where}: {name} is on {t.device}; move it to the CPU first")
    if t.dtype not in STATE_DTYPES:
        raise TypeError(f"{where}: {name} dtype is {t.dtype}; expected float32 or bfloat16")
    if t.numel() != p.numel():
        raise ValueError(
            f"{where}: {name} has {t.numel()} elements (shape {tuple(t.shape)}) but the "
            f"parameter has {p.numel()} (shape {tuple(p.shape)})"
        )
    if not t.is_contiguous():
        raise ValueError(f"{where}: {name} is not contiguous; pass `.contiguous()` tensors")


def view(t: torch.Tensor) -> Any:
    """A numpy array sharing `t`'s memory: float32 as is, bfloat16 as its int16 bits."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def new_state(like: torch.Tensor, dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
    """A contiguous CPU tensor shaped like `like`, filled with `fill`, for optimizer state.

    The one place states are allocated. (States on transparent huge pages were tried
    and measured neutral to 10% slower on 100M-parameter steps here, so plain memory.)
    """
    return torch.full(like.shape, fill, dtype=dtype)


def state_dtype_arg(dtype: torch.dtype) -> torch.dtype:
    """Validate an optimizer's `state_dtype` argument."""
    if dtype not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype={dtype} is not supported; use torch.float32 or torch.bfloat16"
        )
    return dtype
