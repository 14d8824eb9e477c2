"""`BoundLinear` (zserve's decode-step call of a zquant layer's kernel, weight arguments bound
once) gives the zquant module's native output bit for bit (atol 0), also after its codes
moved onto huge pages, and hands the calls it does not run on the kernel to the module.

An INT4 layer's calls (every row count) quantize the activations to INT8 per 32 columns:
those equal the module's output for the rounded activations within 1e-5 of the product's
magnitude, and the module's own within the rounding bound (each activation moved by at most
half its block's scale, `sum |w| · amax / 254`); a row's output is the same bits whatever
shares its call; `ZSERVE_W4_A8=0` restores the module's numbers, and another value of it is
an error."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("zquant")

from zquant.nn import OutlierQuantLinear, QuantLinear
from zquant.quantizers import QuantSpec
from zserve.model.native import pack_on_huge_pages
from zserve.model.quantized_bound import BoundLinear, a8_enabled, bind

W8 = QuantSpec(bits=8, granularity="channel")
W4 = QuantSpec(bits=4, granularity="group", group_size=32)
W4_ASYM = QuantSpec(bits=4, symmetric=False, granularity="group", group_size=64)
FP6 = QuantSpec(bits=6, fmt="fp6", granularity="channel")


def _layer(spec: QuantSpec, act: int | None, outliers: int = 0, bias: bool = True) -> QuantLinear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 96, bias=bias)
    cls = OutlierQuantLinear if outliers else QuantLinear
    layer = cls.from_linear(lin, spec, act)
    if outliers:
        layer.set_outliers(outliers)
    layer.backend = "native"
    return layer


@pytest.mark.parametrize(
    ("spec", "act", "outliers", "bias"),
    [
        (W8, 8, 0, True),
        (W8, 8, 4, False),
        (W4, None, 0, True),
        (W4_ASYM, None, 0, False),
        (FP6, None, 0, True),
    ],
)
@torch.no_grad()
def test_bound_equals_the_module(spec, act, outliers, bias) -> None:
    layer = _layer(spec, act, outliers, bias)
    bound = bind(layer)
    assert isinstance(bound, BoundLinear)
    assert bound.in_features == 128 and bound.spec == spec  # the layer's attributes
    a8 = spec.fmt == "int" and spec.bits <= 4  # INT4: INT8 activations at every row count
    for rows in (1, 3, 4, 5, 16, 17, 64):  # 17: an outlier layer's above 16 rows are torch's
        x = torch.randn(rows, 128) * 3
        if a8:
            _check_a8(bound(x), layer, x)
            alone = torch.cat([bound(x[i : i + 1]) for i in range(rows)])
            assert torch.equal(bound(x), alone), rows  # a row's bits: not its batch's
        else:
            assert torch.equal(bound(x), layer(x)), (spec.describe(), rows)
    # codes moved onto huge pages, views re-taken: the same numbers from the new buffer
    x = torch.randn(2, 128)
    y = bound(x)
    before = layer.qdata.data_ptr()
    pack_on_huge_pages([(layer, "qdata")])
    bound.bind()
    assert layer.qdata.data_ptr() != before
    assert torch.equal(bound(x), y)
    if not a8:
        assert torch.equal(y, layer(x))
    # what the kernel path does not take goes to the module: bf16 activations, wrong width
    xb = torch.randn(2, 128, dtype=torch.bfloat16)
    assert torch.equal(bound(xb), layer(xb))
    with pytest.raises((ValueError, RuntimeError), match="128"):  # the module's own error
        bound(torch.randn(2, 100))


def _rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` rounded as the kernel does (per 32 columns: codes of ``127 / amax``), and each
    element's half step ``amax / 254``."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv)  # round half to even, as the kernel's conversion
    rounded = codes * (amax / 127.0)
    return rounded.reshape(x.shape), (amax / 254.0).expand_as(blocks).reshape(x.shape)


def _check_a8(got: torch.Tensor, layer: QuantLinear, x: torch.Tensor) -> None:
    rounded, half = _rounded(x)
    w = layer.dequantized_weight().double()
    bias = 0.0 if layer.bias is None else layer.bias.double()
    want = rounded.double() @ w.t() + bias
    mag = (rounded.double().abs() @ w.abs().t()) + 1.0
    assert bool(((got.double() - want).abs() <= 1e-5 * mag).all())
    exact = x.double() @ w.t() + bias
    bound = half.double() @ w.abs().t()
    assert bool(((got.double() - exact).abs() <= bound * 1.0001 + 1e-5 * mag).all())
    assert not torch.equal(got, layer(x))  # the activations were rounded


@torch.no_grad()
def test_int4_a8_off_is_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZSERVE_W4_A8", "0")
    layer = _layer(W4, None)
    bound = bind(layer)
    for rows in (1, 4, 64):
        x = torch.randn(rows, 128) * 3
        assert torch.equal(bound(x), layer(x))
    monkeypatch.setenv("ZSERVE_W4_A8", "1")
    assert a8_enabled()


@pytest.mark.parametrize("value", ["yes", "", "2", "off"])
def test_an_unknown_a8_setting_is_an_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("ZSERVE_W4_A8", value)
    with pytest.raises(ValueError, match=rf"ZSERVE_W4_A8='{value}'.*use 1 .* or 0"):
        bind(_layer(W4, None))


def test_fake_quantized_activations_stay_the_module() -> None:
    """W4A8 (activations fake-quantized before a weight-only kernel) and torch-backend layers
    are not bound: the module runs them as it is."""
    w4a8 = _layer(W4, 8)
    assert bind(w4a8) is w4a8
    torch_backend = _layer(W8, 8)
    torch_backend.backend = "torch"
    assert bind(torch_backend) is torch_backend
