"""GPU parity of ``quant_dequant.cu`` with the torch reference (skipped without CUDA;
the source is compile-checked everywhere by tests/znative/test_cuda_nvrtc.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zquant.quantizers import QuantizedWeight, QuantSpec, dequantize_weight, quantize_weight

pytestmark = pytest.mark.gpu

SPECS = [
    QuantSpec(4, granularity="group", group_size=128),
    QuantSpec(4, symmetric=False, granularity="group", group_size=32),
    QuantSpec(4, granularity="tensor"),
    QuantSpec(6, "fp6"),
    QuantSpec(6, "fp6", granularity="group", group_size=128),
]


def _on_cuda(qw: QuantizedWeight) -> QuantizedWeight:
    move = {f.name: getattr(qw, f.name) for f in dataclasses.fields(qw)}
    for key in ("data", "data2", "scale", "zero"):
        if move[key] is not None:
            move[key] = move[key].cuda()
    return QuantizedWeight(**move)


@pytest.fixture(scope="module", autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe().replace(" ", "-"))
def test_dequantize_and_gemv_match_reference(spec: QuantSpec) -> None:
    from zquant.cuda import dequant_gemv_cuda, dequantize_cuda

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 576, generator=g)  # 576 is not a multiple of 128: last group padded
    x = torch.randn(5, 576, generator=g)
    bias = torch.randn(300, generator=g)
    qw = quantize_weight(w, spec)
    ref = dequantize_weight(qw)
    gpu = _on_cuda(qw)
    assert torch.equal(dequantize_cuda(gpu).cpu(), ref)
    got = dequant_gemv_cuda(x.cuda(), gpu, bias.cuda()).cpu()
    want = (x.double() @ ref.double().t() + bias.double()).float()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
