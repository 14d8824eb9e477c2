"""Weight/activation quantizers: error bounds, padding of odd groups, formats, STE, bad specs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zquant.quantizers import (
    QuantizedWeight,
    QuantSpec,
    dequantize_weight,
    expand_groups,
    fake_quantize,
    fake_quantize_activation,
    quantize_activation_tokenwise,
    quantize_weight,
    unpack_codes,
)

INT_SPECS = [
    QuantSpec(8),
    QuantSpec(8, granularity="tensor"),
    QuantSpec(8, symmetric=False),
    QuantSpec(4, granularity="group", group_size=32),
    QuantSpec(4, symmetric=False, granularity="group", group_size=128),
    QuantSpec(2, granularity="group", group_size=16),
    QuantSpec(3, symmetric=False),
    QuantSpec(12, granularity="group", group_size=64),
]


def _tol(qw: QuantizedWeight) -> torch.Tensor:
    return expand_groups(qw.scale, qw.spec, *qw.shape) * (0.5 + 1e-5) + 1e-7


def _range_bound(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Half a step of a grid spanning the whole row (the whole tensor at tensor
    granularity) and zero: a bound on the error that does not trust the scale under test.
    A group's own range is never wider, so its step is never coarser."""
    dims = None if spec.granularity == "tensor" else 1
    lo = w.clamp(max=0).amin() if dims is None else w.clamp(max=0).amin(dim=1, keepdim=True)
    hi = w.clamp(min=0).amax() if dims is None else w.clamp(min=0).amax(dim=1, keepdim=True)
    if spec.symmetric:
        step = torch.maximum(hi, -lo) / (2 ** (spec.bits - 1) - 1)
    else:
        step = (hi - lo) / (2**spec.bits - 1)
    return step * (0.5 + 1e-5) + 1e-7


@settings(max_examples=30, deadline=None)
@given(
    spec=st.sampled_from(INT_SPECS),
    out=st.integers(1, 9),
    in_=st.integers(1, 300),
    seed=st.integers(0, 999),
)
def test_int_error_is_at_most_half_a_step(spec: QuantSpec, out: int, in_: int, seed: int) -> None:
    w = torch.randn(out, in_, generator=torch.Generator().manual_seed(seed)) * 0.05
    qw = quantize_weight(w, spec)
    deq = dequantize_weight(qw)
    assert deq.shape == w.shape and deq.dtype == torch.float32
    assert bool(((w - deq).abs() <= _tol(qw)).all())
    assert bool(((w - deq).abs() <= _range_bound(w, spec)).all())
    # The packed path and the fake-quantize path agree bit for bit.
    assert torch.equal(fake_quantize(w, spec), deq)
    # Serialization round trip is exact.
    again = QuantizedWeight.from_state(qw.to_state())
    assert again.spec == spec and torch.equal(dequantize_weight(again), deq)


@pytest.mark.parametrize(
    "spec, in_",
    [
        (QuantSpec(4, symmetric=False, granularity="group", group_size=32), 33),
        (QuantSpec(8, symmetric=False), 1),
        (QuantSpec(3, symmetric=False), 5),
    ],
)
def test_asymmetric_constant_groups_are_exact(spec: QuantSpec, in_: int) -> None:
    """A group holding one value (a one-column tail group, a one-column layer, a
    constant row) dequantizes to that value: it used to round it to an integer (0.05
    to 0)."""
    w = torch.randn(6, in_, generator=torch.Generator().manual_seed(3)) * 0.05
    w[2] = 0.05  # constant rows: positive, negative, zero
    w[3] = -0.3
    w[4] = 0.0
    deq = dequantize_weight(quantize_weight(w, spec))
    if in_ in (1, 33):  # every row's last group holds one column
        torch.testing.assert_close(deq[:, -1], w[:, -1], rtol=1e-6, atol=0.0)
    torch.testing.assert_close(deq[2:5], w[2:5], rtol=1e-6, atol=0.0)
    assert bool(((w - deq).abs() <= _range_bound(w, spec)).all())


def test_asymmetric_activation_of_a_constant_token_is_exact() -> None:
    x = torch.tensor([[0.05] * 8, [-2.5] * 8, [0.0] * 8])
    torch.testing.assert_close(
        fake_quantize_activation(x, 8, symmetric=False), x, rtol=1e-6, atol=0.0
    )


def test_group_128_on_576_pads_the_last_group() -> None:
    w = torch.randn(16, 576, generator=torch.Generator().manual_seed(0))
    spec = QuantSpec(4, granularity="group", group_size=128)
    qw = quantize_weight(w, spec, layer="mlp.up")
    assert qw.scale.shape == (16, 5)  # 4 full groups + one of 64 padded to 128
    assert qw.data.shape == (16, 288)
    # The last group's scale comes from its 64 real columns only.
    assert torch.allclose(qw.scale[:, 4], w[:, 512:].abs().amax(dim=1) / 7)
    assert bool(((w - dequantize_weight(qw)).abs() <= _tol(qw)).all())


def test_int8_symmetric_codes_are_restricted_range() -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    qw = quantize_weight(w, QuantSpec(8))
    assert qw.data.dtype == torch.int8
    assert int(qw.data.min()) >= -127 and int(qw.data.max()) == 127
    assert torch.equal(unpack_codes(qw), qw.data.to(torch.int32))


def test_fp6_relative_error_and_size() -> None:
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(2))
    qw = quantize_weight(w, QuantSpec(6, "fp6"))
    deq = dequantize_weight(qw)
    # e3m2 has 2 mantissa bits: relative error <= 1/8 for values in the normal range.
    normal = w.abs() >= 0.25 * qw.scale
    assert bool(((w - deq).abs() <= w.abs() / 8 + 1e-6)[normal].all())
    assert torch.allclose(deq.abs().amax(dim=1), w.abs().amax(dim=1))
    assert qw.data.shape == (64, 288) and qw.data2 is not None and qw.data2.shape == (64, 144)
    assert qw.nbytes() == 64 * 576 * 6 // 8 + 64 * 4


def test_binary_is_sign_times_mean_abs() -> None:
    w = torch.randn(8, 40, generator=torch.Generator().manual_seed(3))
    qw = quantize_weight(w, QuantSpec(1, "binary"))
    alpha = w.abs().mean(dim=1, keepdim=True)
    want = torch.where(w >= 0, 1.0, -1.0) * alpha
    assert torch.allclose(dequantize_weight(qw), want)
    assert qw.data.shape == (8, 5)
    assert w.numel() * 4 / qw.nbytes() >= 16


def test_ternary_is_twn() -> None:
    w = torch.randn(8, 50, generator=torch.Generator().manual_seed(4))
    qw = quantize_weight(w, QuantSpec(2, "ternary"))
    delta = 0.7 * w.abs().mean(dim=1, keepdim=True)
    keep = w.abs() > delta
    alpha = (w.abs() * keep).sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True)
    want = torch.sign(w) * keep * alpha
    assert torch.allclose(dequantize_weight(qw), want)


SIGN_SPECS = [
    QuantSpec(1, "binary"),
    QuantSpec(1, "binary", granularity="group", group_size=16),
    QuantSpec(1, "binary", granularity="tensor"),
    QuantSpec(2, "ternary"),
    QuantSpec(2, "ternary", granularity="group", group_size=24),
]


@settings(max_examples=30, deadline=None)
@given(
    spec=st.sampled_from(SIGN_SPECS),
    out=st.integers(1, 9),
    in_=st.integers(1, 120),
    seed=st.integers(0, 999),
)
def test_binary_and_ternary_fake_quantize_equal_the_packed_path(
    spec: QuantSpec, out: int, in_: int, seed: int
) -> None:
    """fake_quantize skips building codes for binary/ternary; its values stay bit-identical
    to packing and unpacking (padded last groups, exact zeros included)."""
    w = torch.randn(out, in_, generator=torch.Generator().manual_seed(seed))
    w[0, 0] = 0.0  # zero counts as + for binary, as dropped for ternary
    assert torch.equal(fake_quantize(w, spec), dequantize_weight(quantize_weight(w, spec)))


def test_fake_quantize_passes_gradient_straight_through_and_keeps_dtype() -> None:
    w = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    y = fake_quantize(w, QuantSpec(4, granularity="group", group_size=8))
    assert y.dtype == torch.bfloat16 and y.shape == w.shape
    (y.float() * torch.arange(32.0)).sum().backward()
    assert w.grad is not None and torch.equal(w.grad.float(), torch.arange(32.0).expand(4, 32))
    x = torch.randn(3, 5, 16, requires_grad=True)
    fake_quantize_activation(x).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones_like(x))


def test_tokenwise_activation_quantization() -> None:
    x = torch.randn(2, 7, 96, generator=torch.Generator().manual_seed(5)) * 3
    q, scale = quantize_activation_tokenwise(x)
    assert q.dtype == torch.int8 and scale.shape == (2, 7, 1) and scale.dtype == torch.float32
    assert int(q.abs().max()) == 127
    assert bool(((q.float() * scale - x).abs() <= scale / 2 + 1e-6).all())
    assert torch.equal(fake_quantize_activation(x), q.float() * scale)
    asym = fake_quantize_activation(x, bits=4, symmetric=False)
    step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 15
    assert bool(((asym - x).abs() <= step / 2 + 1e-5).all())
    zeros_q, zeros_scale = quantize_activation_tokenwise(torch.zeros(3, 8))
    assert not bool(zeros_q.any()) and bool(torch.isfinite(zeros_scale).all())


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (QuantSpec(0), "bits=0 is out of range"),
        (QuantSpec(17), "bits=17 is out of range"),
        (QuantSpec(1), "fmt='binary'"),
        (QuantSpec(4, "fp6"), "needs bits=6"),
        (QuantSpec(6, "fp6", symmetric=False), "symmetric only"),
        (QuantSpec(4, granularity="group"), "needs group_size"),
        (QuantSpec(4, granularity="group", group_size=0), "group_size=0 must be a positive int"),
        (QuantSpec(4, granularity="group", group_size=-8), "group_size=-8"),
        (QuantSpec(4, group_size=32), "granularity='group'"),
        (QuantSpec(4, fmt="int5"), "unknown"),  # type: ignore[arg-type]
    ],
)
def test_bad_specs_name_layer_shape_and_fix(spec: QuantSpec, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        quantize_weight(torch.randn(8, 576), spec, layer="model.layers.0.mlp.up_proj")
    assert "model.layers.0.mlp.up_proj" in str(err.value) and "(8, 576)" in str(err.value)
    assert any(word in str(err.value) for word in ("use", "set"))


def test_non_finite_weights_are_rejected() -> None:
    w = torch.randn(4, 8)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN/inf"):
        quantize_weight(w, QuantSpec(8), layer="fc")
