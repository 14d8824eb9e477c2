"""znative quantization kernels against the zquant torch reference: int8 GEMM exact in
int32, token-wise quantization and dequantization bit-exact, fused linears within float
rounding; every SIMD level agrees; bad buffers raise typed errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import znative
from tests.znative.simd_levels import LEVELS
from zquant import native
from zquant.quantizers import (
    QuantSpec,
    dequantize_weight,
    quantize_activation_tokenwise,
    quantize_weight,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 140), k=st.integers(1, 300), seed=st.integers(0, 999))
def test_int8_gemm_is_exact(m: int, n: int, k: int, seed: int) -> None:
    a = torch.randint(-128, 128, (m, k), generator=_gen(seed), dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=_gen(seed + 1), dtype=torch.int8)
    want = (a.to(torch.int64) @ b.to(torch.int64).t()).to(torch.int32)
    for level in LEVELS:
        znative.set_simd_level(level)
        try:
            assert torch.equal(native.int8_gemm(a, b), want), level
        finally:
            znative.set_simd_level(None)


def test_int8_gemm_extremes_and_vnni_flag(simd: str) -> None:
    a = torch.full((5, 1000), -128, dtype=torch.int8)
    b = torch.full((7, 1000), -127, dtype=torch.int8)
    assert bool((native.int8_gemm(a, b) == 128 * 127 * 1000).all())
    assert isinstance(znative.int8_vnni_available(), bool)
    if simd != "avx512":
        assert not znative.int8_vnni_available()


@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 20),
    k=st.integers(1, 200),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 999),
)
def test_tokenwise_quantization_is_bit_exact(m: int, k: int, scale: float, seed: int) -> None:
    x = torch.randn(m, k, generator=_gen(seed)) * scale
    x[0] = 0.0  # an all-zero token gets scale 1
    q, s = native.quantize_tokenwise(x)
    q_ref, s_ref = quantize_activation_tokenwise(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


WEIGHT_SPECS = [
    QuantSpec(4, granularity="group", group_size=128),
    QuantSpec(4, granularity="group", group_size=32),
    QuantSpec(4, symmetric=False, granularity="group", group_size=64),
    QuantSpec(4),
    QuantSpec(4, granularity="tensor"),
    QuantSpec(3, symmetric=False),
    QuantSpec(6, "fp6"),
    QuantSpec(6, "fp6", granularity="group", group_size=128),
]


@settings(max_examples=30, deadline=None)
@given(
    spec=st.sampled_from([*WEIGHT_SPECS, QuantSpec(4, granularity="group", group_size=7)]),
    n=st.integers(1, 40),
    k=st.integers(1, 300),
    seed=st.integers(0, 999),
)
def test_dequantize_is_bit_exact_including_padded_groups(
    spec: QuantSpec, n: int, k: int, seed: int
) -> None:
    w = torch.randn(n, k, generator=_gen(seed))
    qw = quantize_weight(w, spec)
    assert torch.equal(native.dequantize(qw), dequantize_weight(qw))


@pytest.mark.parametrize("spec", WEIGHT_SPECS, ids=lambda s: s.describe().replace(" ", "-"))
def test_dequant_linear_matches_reference(spec: QuantSpec, simd: str) -> None:
    w = torch.randn(70, 576, generator=_gen(1))  # 576 = 4.5 groups of 128: the last is padded
    x = torch.randn(9, 576, generator=_gen(2))
    bias = torch.randn(70, generator=_gen(3))
    qw = quantize_weight(w, spec)
    deq = dequantize_weight(qw)
    assert torch.equal(native.dequantize(qw), deq)
    want = (x.double() @ deq.double().t() + bias.double()).float()
    got = native.dequant_linear(x, qw, bias)
    bound = 1e-5 * (x.abs().double() @ deq.abs().double().t()).float() + 1e-6
    assert bool(((got - want).abs() <= bound).all())


def test_int8_linear_is_bit_identical_to_torch_path(simd: str) -> None:
    x = torch.randn(33, 384, generator=_gen(4)) * 2
    w = torch.randn(150, 384, generator=_gen(5))
    bias = torch.randn(150, generator=_gen(6))
    qw = quantize_weight(w, QuantSpec(8))
    q, s = quantize_activation_tokenwise(x)
    acc = (q.to(torch.int64) @ qw.data.to(torch.int64).t()).to(torch.int32)
    want = acc.to(torch.float32) * (s * qw.scale.reshape(1, -1)) + bias
    assert torch.equal(native.int8_linear(x, qw.data, qw.scale.reshape(-1), bias), want)
    per_tensor = quantize_weight(w, QuantSpec(8, granularity="tensor"))
    acc_t = (q.to(torch.int64) @ per_tensor.data.to(torch.int64).t()).to(torch.int32)
    want_t = acc_t.to(torch.float32) * (s * per_tensor.scale.reshape(1, -1))
    assert torch.equal(native.int8_linear(x, per_tensor.data, per_tensor.scale.reshape(-1)), want_t)


def test_bad_buffers_raise_typed_errors_and_leave_output_alone() -> None:
    a = np.zeros((4, 8), np.int8)
    out = np.full((4, 3), 7, np.int32)
    with pytest.raises(znative.ShapeMismatchError, match=r"b has 15 elements but n·k = 3·8 = 24"):
        znative.int8_gemm(a, np.zeros((3, 5), np.int8), out)
    assert bool((out == 7).all())
    with pytest.raises(znative.DTypeError, match="b: expected dtype int8, got float32"):
        znative.int8_gemm(a, np.zeros((3, 8), np.float32), out)
    with pytest.raises(znative.LayoutError, match="not C-contiguous"):
        znative.int8_gemm(a, np.zeros((8, 3), np.int8).T, out)
    with pytest.raises(znative.HyperparameterError, match="bits = 9"):
        znative.quantize_tokenwise(
            np.zeros((2, 4), np.float32), np.zeros((2, 4), np.int8), np.zeros(2, np.float32), bits=9
        )
    x = np.zeros((2, 8), np.float32)
    y = np.zeros((2, 3), np.float32)
    with pytest.raises(znative.HyperparameterError, match="group_size = 0"):
        znative.dequant_linear(
            x,
            np.zeros((3, 4), np.uint8),
            np.ones((3, 1), np.float32),
            None,
            y,
            fmt="int4",
            group_size=0,
        )
    with pytest.raises(znative.ShapeMismatchError, match="data2 has 0 elements"):
        znative.dequant_linear(
            x,
            np.zeros((3, 4), np.uint8),
            np.ones((3, 1), np.float32),
            None,
            y,
            fmt="fp6",
            group_size=8,
        )
    with pytest.raises(znative.HyperparameterError, match="fmt"):
        znative.dequant_linear(
            x,
            np.zeros((3, 4), np.uint8),
            np.ones((3, 1), np.float32),
            None,
            y,
            fmt="int2",
            group_size=8,
        )
    assert bool((y == 0).all())
