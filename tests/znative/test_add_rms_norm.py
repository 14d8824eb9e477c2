"""znative.add_rms_norm (a decoder layer's residual add fused into the next RMSNorm) gives
the bits of its two steps: ``x += delta`` in torch, then ``znative.rms_norm`` of the sum
(itself bit-identical to ``zserve.model.llama.rms_norm``), float32 and bfloat16, at every
SIMD level the CPU has; bad input is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

import znative
from zserve.model.llama import rms_norm
from zserve.model.native import np_view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_then_norm_bit_for_bit(simd: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 576, generator=g) * 3).to(dtype)
    delta = torch.randn(3, 576, generator=g).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    want_x = x + delta
    want = torch.empty_like(x)
    znative.rms_norm(np_view(want_x), np_view(w), np_view(want), eps=1e-5)
    got = torch.empty_like(x)
    znative.add_rms_norm(np_view(x), np_view(delta), np_view(w), np_view(got), eps=1e-5)
    assert torch.equal(x, want_x)
    assert torch.equal(got, want)
    if dtype == torch.float32:  # and the readable reference's bits
        assert torch.equal(got, rms_norm(want_x, w, 1e-5))


def test_bad_input_is_refused_and_nothing_written() -> None:
    x, out = torch.ones(2, 8), torch.full((2, 8), 7.0)
    with pytest.raises(ValueError, match="delta"):
        znative.add_rms_norm(
            x.numpy(), torch.ones(15).numpy(), torch.ones(8).numpy(), out.numpy(), eps=1e-5
        )
    with pytest.raises(TypeError, match="must all be float32 or all bfloat16"):
        znative.add_rms_norm(
            x.numpy(),
            x.numpy(),
            np_view(torch.ones(8, dtype=torch.bfloat16)),
            out.numpy(),
            eps=1e-5,
        )
    assert torch.all(x == 1.0) and torch.all(out == 7.0)
