"""``znative.dequant_linear(..., act_bits=8)`` at every SIMD level: the INT4 product of the
activations rounded to INT8 per 32 columns (computed here in torch), within 1e-5 of the
product's magnitude; and the arguments it refuses, with errors that name them."""

from __future__ import annotations

import pytest
import torch

import znative
from zquant import native
from zquant.quantizers import QuantSpec, dequantize_weight, quantize_weight


def _rounded(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


def _call(x: torch.Tensor, qw: object, **extra: object) -> torch.Tensor:
    args = native.packed_args(qw)  # type: ignore[arg-type]
    out = torch.empty(x.shape[0], qw.shape[0])  # type: ignore[attr-defined]
    data, scale = args.pop("data"), args.pop("scale")
    znative.dequant_linear(x.numpy(), data, scale, None, out.numpy(), **args, **extra)  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("m", [1, 2, 4, 6, 33])  # 1-4: the GEMV body
@pytest.mark.parametrize("symmetric", [True, False])
def test_a8_is_the_product_of_the_rounded_activations(simd: str, m: int, symmetric: bool) -> None:
    g = torch.Generator().manual_seed(m)
    w = torch.randn(70, 192, generator=g)
    x = torch.randn(m, 192, generator=g) * 2
    spec = QuantSpec(4, symmetric=symmetric, granularity="group", group_size=64)
    qw = quantize_weight(w, spec)
    deq = dequantize_weight(qw).double()
    got = _call(x, qw, act_bits=8)
    want = _rounded(x).double() @ deq.t()
    mag = _rounded(x).double().abs() @ deq.abs().t() + 1.0
    assert bool(((got.double() - want).abs() <= 1e-5 * mag).all()), simd


def test_bad_arguments_are_named() -> None:
    x = torch.randn(2, 64)
    qw = quantize_weight(torch.randn(8, 64), QuantSpec(4, granularity="group", group_size=32))
    with pytest.raises(ValueError, match="act_bits = 4"):
        _call(x, qw, act_bits=4)
    fp6 = quantize_weight(torch.randn(8, 64), QuantSpec(6, fmt="fp6", granularity="channel"))
    with pytest.raises(ValueError, match="INT4"):
        _call(x, fp6, act_bits=8)
