"""Sign packing: round trips, DeepSpeed's bit conventions, and the 1-bit scale."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zcomm import kernels
from zcomm.signs import pack_signs, packed_bytes, sign_scale, signs, unpack_signs


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 16, 17, 63, 64, 1000])
def test_round_trip_any_size(n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_bytes(n) == math.ceil(n / 8)
    assert torch.equal(unpack_signs(packed, n), torch.where(x < 0, -1.0, 1.0))


def test_zeros_nan_and_negative_zero_count_as_plus_one() -> None:
    # DeepSpeed's x.sign().add_(1).bool(): sign 0 (either zero) and NaN give True, i.e. +1.
    x = torch.tensor([0.0, -0.0, float("nan"), -1e-30, 1e-30, -float("inf"), float("inf")])
    expected = torch.tensor([1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 1.0])
    assert torch.equal(unpack_signs(pack_signs(x), x.numel()), expected)
    assert torch.equal(signs(x), expected)
    deepspeed = x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)
    assert torch.equal(deepspeed, expected)


def test_bit_order_is_numpy_packbits() -> None:
    # Most significant bit first, unused low bits of the last byte zero: cupy/numpy.packbits.
    x = torch.randn(29, generator=torch.Generator().manual_seed(1))
    x[5] = 0.0
    expected = np.packbits((x >= 0).numpy())
    assert pack_signs(x).numpy().tolist() == expected.tolist()


def test_reads_any_shape_flat_and_keeps_dtype() -> None:
    x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(unpack_signs(pack_signs(x), 15, torch.float64), signs(x).reshape(-1))
    assert signs(x).shape == (3, 5) and signs(x).dtype == torch.float64
    assert unpack_signs(pack_signs(x), 15, torch.bfloat16).dtype == torch.bfloat16


def test_unpack_refuses_too_few_bytes_and_wrong_dtype() -> None:
    with pytest.raises(ValueError, match="2 packed bytes hold 16 signs, not 17"):
        unpack_signs(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(TypeError, match="uint8"):
        unpack_signs(torch.zeros(2, dtype=torch.int8), 8)


def test_scale_keeps_the_l2_norm() -> None:
    x = torch.randn(37, generator=torch.Generator().manual_seed(3))
    scale = sign_scale(x)
    assert torch.equal(scale, torch.linalg.norm(x) / math.sqrt(37))
    assert torch.allclose(torch.linalg.norm(scale * signs(x)), torch.linalg.norm(x))
    assert sign_scale(torch.zeros(0)).item() == 0.0


# ---- the dispatching versions (zcomm.kernels: native on CPU float32 / bfloat16) ---------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 9, 1000, 200_003])
def test_dispatch_packs_and_unpacks_bit_for_bit(dtype: torch.dtype, n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    if n > 3:
        x[:3] = torch.tensor([-0.0, float("nan"), -float("inf")])
    packed, scale = kernels.pack_signs_scaled(x)
    assert torch.equal(packed, pack_signs(x))
    assert torch.equal(kernels.pack_signs(x), pack_signs(x))
    assert scale.dtype == dtype and scale.dim() == 0
    assert torch.equal(kernels.unpack_signs(packed, n, dtype), unpack_signs(packed, n, dtype))
    scaled = kernels.unpack_signs_scaled(packed, n, 0.375)
    assert torch.equal(scaled, unpack_signs(packed, n) * 0.375)


def test_dispatch_scale_is_the_l2_scale() -> None:
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(5)).t()  # not contiguous
    packed, scale = kernels.pack_signs_scaled(x)
    assert torch.equal(packed, pack_signs(x))
    exact = math.sqrt(float(x.double().square().sum()) / x.numel())
    assert float(scale) == pytest.approx(exact, rel=2e-7)
    assert kernels.pack_signs_scaled(torch.zeros(0))[1].item() == 0.0


def test_dispatch_unpack_checks_like_the_reference() -> None:
    with pytest.raises(ValueError, match="2 packed bytes hold 16 signs, not 17"):
        kernels.unpack_signs(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(TypeError, match="uint8"):
        kernels.unpack_signs(torch.zeros(2, dtype=torch.int8), 8)
