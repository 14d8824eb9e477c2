"""`OutlierQuantLinear`'s W8A8 split as one native call (``znative.int8_linear(...,
outliers=k)``, used for calls of at most ``FUSED_OUTLIER_MAX_ROWS`` rows, i.e. decode steps)
against its torch reference (the same layer with ``backend="torch"``: abs/amax/topk, the
INT8 linear of the rest, the outlier columns in float32). The INT8 codes and int32 sums are
the same; the float32 outlier term sums its k products in another order than torch's matmul,
so the outputs agree to float32 rounding: |got - want| <= 1e-5 (1 + |want|)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import znative
from zquant.nn import FUSED_OUTLIER_MAX_ROWS, OutlierQuantLinear
from zquant.quantizers import QuantSpec

_ORDER = ("scalar", "avx2", "avx512")
LEVELS = _ORDER[: _ORDER.index(znative.detected_simd_level()) + 1]


def _layer(bias: bool, outliers: int) -> OutlierQuantLinear:
    torch.manual_seed(0)
    lin = nn.Linear(576, 200, bias=bias)
    layer = OutlierQuantLinear.from_linear(lin, QuantSpec(8), act_bits=8, name="proj")
    return layer.set_outliers(outliers)


@pytest.mark.parametrize("simd", LEVELS)
@pytest.mark.parametrize(("rows", "bias", "outliers"), [(1, False, 8), (3, True, 8), (16, True, 1)])
def test_fused_split_matches_the_torch_ops(simd: str, rows: int, bias: bool, outliers: int) -> None:
    layer = _layer(bias, outliers)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    x[:, 17] *= 40.0  # residual-stream-like outlier channels
    x[0, 300] = -55.0
    layer.backend = "torch"
    want = layer(x)
    layer.backend = "native"
    znative.set_simd_level(simd)
    try:
        got = layer(x)
    finally:
        znative.set_simd_level(None)
    assert got.shape == want.shape == (rows, 200)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_large_calls_keep_the_torch_ops_bit_for_bit() -> None:
    # Above the row limit the native backend runs the torch split over the native INT8
    # linear (bit-identical to torch's _int_mm path): what `z eval` and perplexity see.
    layer = _layer(True, 8)
    x = torch.randn(FUSED_OUTLIER_MAX_ROWS + 1, 576, generator=torch.Generator().manual_seed(1))
    layer.backend = "torch"
    want = layer(x)
    layer.backend = "native"
    assert torch.equal(layer(x), want)


def test_too_many_outliers_is_a_clear_error() -> None:
    x = torch.randn(1, 8).numpy()
    w = torch.ones(2, 8, dtype=torch.int8).numpy()
    out = torch.empty(1, 2).numpy()
    with pytest.raises(ValueError, match="outliers"):
        znative.int8_linear(x, w, torch.ones(2).numpy(), None, out, outliers=9)


@pytest.mark.parametrize("simd", LEVELS)
def test_column_absmax_is_torch_abs_amax(simd: str) -> None:
    """`znative.column_absmax` (zserve's column maxima for a prompt's outlier channels) is
    ``x.abs().amax(0)`` to the bit, NaN included, at every SIMD level."""
    x = torch.randn(37, 100, generator=torch.Generator().manual_seed(5)) * 7
    x[3, 9] = float("nan")
    out = torch.empty(100)
    znative.set_simd_level(simd)
    try:
        znative.column_absmax(x.numpy(), out.numpy())
    finally:
        znative.set_simd_level(None)
    torch.testing.assert_close(out, x.abs().amax(0), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="out"):
        znative.column_absmax(x.numpy(), torch.empty(99).numpy())
