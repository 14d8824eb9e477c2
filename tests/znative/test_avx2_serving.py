"""zserve's serving kernels at every SIMD level the CPU has (the AVX2 bodies among them),
against their torch references: the INT8 linear bit-identical to the torch path for decode
rows (1-3, the streamed body) and tiles (4+ rows, k with and without a 16-wide tail), the
INT4 and FP6 dequantize-GEMV and the dequantize tile path (more rows) within float32
rounding of the dequantized product, RMSNorm bit-identical to torch's, the W8A8 outlier
split of a prompt's rows bit-identical to the torch path, and ``linear_rows`` in float32
and bfloat16 for 1-64 rows; and zserve's routing of bfloat16 batches below AVX-512."""

from __future__ import annotations

import pytest
import torch

import znative
from zquant import native
from zquant.quantizers import (
    QuantSpec,
    dequantize_weight,
    quantize_activation_tokenwise,
    quantize_weight,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("m", "k"), [(1, 576), (2, 100), (3, 37), (4, 64), (7, 100), (17, 576)])
def test_int8_linear_bit_identical_to_torch_path(simd: str, m: int, k: int) -> None:
    x = torch.randn(m, k, generator=_gen(m)) * 3
    w = torch.randn(70, k, generator=_gen(k))
    qw = quantize_weight(w, QuantSpec(8))
    q, s = quantize_activation_tokenwise(x)
    acc = (q.to(torch.int64) @ qw.data.to(torch.int64).t()).to(torch.int32)
    want = acc.to(torch.float32) * (s * qw.scale.reshape(1, -1))
    assert torch.equal(native.int8_linear(x, qw.data, qw.scale.reshape(-1)), want), simd


@pytest.mark.parametrize("bias", [False, True])
def test_outlier_split_of_a_prompt_equals_the_torch_path(simd: str, bias: bool) -> None:
    """`OutlierQuantLinear` at more rows than a decode step's, native backend (one
    `int8_linear_split` call and torch's sum of the outlier term) against the torch backend
    (`z eval`'s: abs, amax, topk, index_fill, `torch._int_mm`, the weight columns' matmul)."""
    from zquant.nn import FUSED_OUTLIER_MAX_ROWS, OutlierQuantLinear

    torch.manual_seed(3)
    lin = torch.nn.Linear(96, 40, bias=bias)
    layer = OutlierQuantLinear.from_linear(lin, QuantSpec(bits=8, granularity="channel"), 8)
    layer.set_outliers(4)
    x = torch.randn(FUSED_OUTLIER_MAX_ROWS + 9, 96, generator=_gen(4)) * 2
    x[:, [5, 70]] *= 30  # residual-stream-like outlier channels
    x[:, 20] *= 5
    # Tied column maxima (GQA's attention outputs: a KV group's heads equal at the first
    # token), inside the chosen channels (71) and across the cut (21, 22): torch's topk
    # orders ties its own way, which the native path must follow.
    x[:, 71], x[:, 21], x[:, 22] = x[:, 70], x[:, 20], x[:, 20]
    layer.backend = "native"
    got = layer(x)
    layer.backend = "torch"
    assert torch.equal(got, layer(x)), simd


@pytest.mark.parametrize("m", [1, 3, 5, 8, 9, 16, 70])
@pytest.mark.parametrize("spec", ["int4", "int4-asym", "fp6", "fp6-g64"])
def test_dequant_linear_matches_the_dequantized_product(simd: str, m: int, spec: str) -> None:
    """The GEMV (INT4 and FP6, up to 8 rows below AVX-512's INT4 body) and the tile path
    (more rows); FP6 with a short last group (576 = 9 groups of 64)."""
    w = torch.randn(70, 576, generator=_gen(7))
    x = torch.randn(m, 576, generator=_gen(8))
    if spec == "fp6":
        qspec = QuantSpec(6, fmt="fp6", granularity="channel")
    elif spec == "fp6-g64":
        qspec = QuantSpec(6, fmt="fp6", granularity="group", group_size=64)
    else:
        qspec = QuantSpec(4, symmetric=spec == "int4", granularity="group", group_size=32)
    qw = quantize_weight(w, qspec)
    deq = dequantize_weight(qw)
    want = (x.double() @ deq.double().t()).float()
    got = native.dequant_linear(x, qw, None)
    bound = 1e-5 * (x.abs().double() @ deq.abs().double().t()).float() + 1e-6
    assert bool(((got - want).abs() <= bound).all()), simd


@pytest.mark.parametrize("h", [5, 100, 576, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bit_identical_to_the_torch_reference(
    simd: str, h: int, dtype: torch.dtype
) -> None:
    """The AVX2 body (AVX2 and AVX-512) adds the squares in torch's order, as the portable
    one: every bit equal, rows below one vector, with tails and long enough to cascade."""
    from zserve.model import native as zn
    from zserve.model.llama import rms_norm

    x = (torch.randn(6, h, generator=_gen(h)) * torch.logspace(-2, 3, h)).to(dtype)
    w = (torch.rand(h, generator=_gen(h + 1)) + 0.5).to(dtype)
    assert torch.equal(zn.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)), simd


@pytest.mark.parametrize("m", [1, 4, 5, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_matches_torch(simd: str, m: int, dtype: torch.dtype) -> None:
    k, n = 100, 300  # k: 12 whole 8-wide steps and a tail of 4; n: two tasks of rows
    x = torch.randn(m, k, generator=_gen(m)).to(dtype)
    w = torch.randn(n, k, generator=_gen(n)).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    view = (
        (lambda t: t.view(torch.int16).numpy()) if dtype == torch.bfloat16 else torch.Tensor.numpy
    )
    znative.linear_rows(view(x), view(w), view(out))
    exact = x.double() @ w.double().t()
    mag = x.abs().double() @ w.abs().double().t()
    # f32 sums in another order; bfloat16 rounds the result once (2^-8 relative).
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert bool(((out.double() - exact).abs() <= tol * (mag + 1)).all()), simd


def test_bf16_batches_run_on_the_kernel_below_avx512(simd: str) -> None:
    from zserve.model import native as zn

    w = torch.zeros(8, 8, dtype=torch.bfloat16)
    rows = zn.kernel_rows(w, torch.bfloat16)
    if simd == "avx512":
        assert rows == zn.LINEAR_MAX_ROWS
    else:
        assert rows == zn.BF16_NO_AVX512_MAX_ROWS
    assert zn.kernel_rows(w.float(), torch.float32) == zn.LINEAR_MAX_ROWS
