"""`BoundLinear` (zserve's decode-step call of a zquant layer's kernel, weight arguments bound
once) gives the zquant module's native output bit for bit (atol 0), also after its codes
moved onto huge pages, and hands the calls it does not run on the kernel to the module."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("zquant")

from zquant.nn import OutlierQuantLinear, QuantLinear
from zquant.quantizers import QuantSpec
from zserve.model.native import pack_on_huge_pages
from zserve.model.quantized_bound import BoundLinear, bind

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
    for rows in (1, 3, 16, 17, 64):  # 17: an outlier layer's calls above 16 rows are torch's
        x = torch.randn(rows, 128) * 3
        assert torch.equal(bound(x), layer(x)), (spec.describe(), rows)
    # codes moved onto huge pages, views re-taken: the same numbers from the new buffer
    before = layer.qdata.data_ptr()
    pack_on_huge_pages([(layer, "qdata")])
    bound.bind()
    assert layer.qdata.data_ptr() != before
    x = torch.randn(2, 128)
    assert torch.equal(bound(x), layer(x))
    # what the kernel path does not take goes to the module: bf16 activations, wrong width
    xb = torch.randn(2, 128, dtype=torch.bfloat16)
    assert torch.equal(bound(xb), layer(xb))
    with pytest.raises((ValueError, RuntimeError), match="128"):  # the module's own error
        bound(torch.randn(2, 100))


def test_fake_quantized_activations_stay_the_module() -> None:
    """W4A8 (activations fake-quantized before a weight-only kernel) and torch-backend layers
    are not bound: the module runs them as it is."""
    w4a8 = _layer(W4, 8)
    assert bind(w4a8) is w4a8
    torch_backend = _layer(W8, 8)
    torch_backend.backend = "torch"
    assert bind(torch_backend) is torch_backend
