"""GPU parity of ``random_ltd.cu`` (random-LTD's gather/scatter) with the torch reference
(skipped without CUDA; the source is compile-checked everywhere by
tests/znative/test_cuda_nvrtc.py)."""

from __future__ import annotations

import pytest
import torch

from zcore.data_efficiency import token_routing as tr

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("B", "T", "K", "C"), [(2, 16, 5, 8), (4, 512, 160, 1024), (3, 7, 7, 33)])
def test_kernels_equal_the_reference_values_and_grads(
    dtype: torch.dtype, B: int, T: int, K: int, C: int
) -> None:
    from zcore.data_efficiency import token_routing_cuda

    assert token_routing_cuda.available()
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = tr.sample_indices(B, T, K, "cuda", generator=g)
    x = torch.randn(B, T, C, device="cuda", generator=g).to(dtype)
    w = torch.randn(B, T, C, device="cuda", generator=g).to(dtype)

    def run(gather, scatter):  # type: ignore[no-untyped-def]
        xi = x.clone().requires_grad_()
        part = gather(xi, idx)
        out = scatter(xi, part * 3, idx)
        (out * w).sum().backward()
        return part.detach(), out.detach(), xi.grad

    fast = run(tr.gather_tokens, tr.scatter_tokens)
    ref = run(tr.gather_reference, tr.scatter_reference)
    for a, b in zip(fast, ref, strict=True):
        assert torch.equal(a, b)  # copies: bit-exact
    # the kernels themselves, not a torch fallback
    assert torch.equal(token_routing_cuda.gather(x, idx), tr.gather_reference(x, idx))
