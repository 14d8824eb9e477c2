"""Dynamic token-wise activation quantization (ZeroQuant) and the straight-through estimator.

Activations are quantized per token (per row of the last dimension) at run
time: ``scale = max|x| / (2**(bits-1) - 1)`` (symmetric) or min/max with a zero
point (asymmetric, simulated only). :mod:`zquant.quantizers` re-exports both
functions; the native twin is ``znative.quantize_tokenwise``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class StraightThrough(torch.autograd.Function):
    """Returns the quantized value forward, passes the gradient to the input unchanged."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, q: Tensor) -> Tensor:
        return q

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def minmax_scale(lo: Tensor, hi: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Asymmetric scale and zero point (float32 holding integers) for values in
    ``[lo, hi]`` on codes ``0 .. 2**bits - 1``.

    A constant group (``lo == hi``) takes the range from zero to its value, so the value
    is a code exactly (a scale of 1 would round it to the nearest integer: 0.05 to 0).
    """
    const = hi == lo
    zero = torch.zeros_like(lo)
    lo = torch.where(const, torch.minimum(lo, zero), lo)
    hi = torch.where(const, torch.maximum(hi, zero), hi)
    scale = torch.where(hi > lo, (hi - lo) / (2**bits - 1), torch.ones_like(hi))
    return scale, torch.round(-lo / scale)


def _act_scale(x: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, Tensor | None]:
    x = x.to(torch.float32)
    if symmetric:
        absmax = x.abs().amax(dim=-1, keepdim=True)
        qmax = 2 ** (bits - 1) - 1
        return torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax)), None
    return minmax_scale(x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True), bits)


def _check_act_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"activation bits={bits!r} is out of range; use 2..8 (8 for W8A8)")


def quantize_activation_tokenwise(
    x: Tensor, bits: int = 8, symmetric: bool = True
) -> tuple[Tensor, Tensor]:
    """Dynamic per-token (last-dim row) symmetric quantization: ``(q int8 (..., d), scale fp32 (..., 1))``
    with ``x ≈ q * scale`` and ``|q| <= 2**(bits-1) - 1``."""
    _check_act_bits(bits)
    if not symmetric:
        raise ValueError(
            "quantize_activation_tokenwise: integer activations are symmetric (int8 GEMM has no zero point); "
            "use symmetric=True, or fake_quantize_activation(x, symmetric=False) to simulate asymmetric"
        )
    scale, _ = _act_scale(x, bits, True)
    qmax = 2 ** (bits - 1) - 1
    q = torch.clamp(torch.round(x.to(torch.float32) / scale), -qmax, qmax).to(torch.int8)
    return q, scale


def fake_quantize_activation(x: Tensor, bits: int = 8, symmetric: bool = True) -> Tensor:
    """Per-token quantize→dequantize of ``x`` (same shape/dtype), straight-through gradient."""
    _check_act_bits(bits)
    with torch.no_grad():
        xf = x.detach().to(torch.float32)
        scale, zero = _act_scale(xf, bits, symmetric)
        if zero is None:
            qmax = 2 ** (bits - 1) - 1
            deq = torch.clamp(torch.round(xf / scale), -qmax, qmax) * scale
        else:
            deq = (torch.clamp(torch.round(xf / scale) + zero, 0, 2**bits - 1) - zero) * scale
    return StraightThrough.apply(x, deq.to(x.dtype))
