"""znative's compressed-collective kernels against zcomm's torch references.

Signs (``zcomm.signs``): the packed bytes are bit-identical at every SIMD level and size,
including -0.0, NaN, infinities, odd sizes and the empty tensor, for float32 and bfloat16
input; the fused sum of squares agrees with a float64 sum to 1e-6 relative (the scale from
it to float32 rounding); unpack writes
exactly ``+scale`` / ``-scale``.

Blockwise INT8 / INT4 (``zcomm.blockquant``): codes and scales bit-identical to the reference
(NaN scales included), dequantization bit-identical, and the round trip within half a step
(``scale / 2``, with 1e-6 relative slack for the division's rounding) per element.

The ``gpu`` tests run the ``.cu`` twins against the same references and skip without a CUDA
device and CuPy; ``tests/znative/test_cuda_nvrtc.py`` compile-checks the sources everywhere.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import znative
from zcomm import blockquant, kernels, signs

PART = 1 << 16  # the kernels' parallel part: sizes above it run on several threads
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 1023, 1025, 3 * PART + 13]
SPECIAL = [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), -1e-30, 1e-30]


def _data(n: int, seed: int, *, special: bool = True) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if special and n:
        idx = torch.arange(0, n, 97)
        x[idx] = torch.tensor(SPECIAL)[torch.arange(idx.numel()) % len(SPECIAL)]
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


# ---- signs -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_pack_signs_is_bit_exact(simd: str, n: int) -> None:
    x = _data(n, n)
    want = signs.pack_signs(x)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        out = torch.full((signs.packed_bytes(n),), 0xAA, dtype=torch.uint8)
        arr = xd.view(torch.int16).numpy() if dtype == torch.bfloat16 else xd.numpy()
        znative.pack_signs(arr, out.numpy())
        assert torch.equal(out, want), (simd, n, dtype)


@pytest.mark.parametrize("n", [1, 9, 1000, 3 * PART + 13])
def test_fused_sum_of_squares(simd: str, n: int) -> None:
    x = _data(n, n, special=False)
    out = torch.empty(signs.packed_bytes(n), dtype=torch.uint8)
    sumsq = znative.pack_signs(x.numpy(), out.numpy())
    want = float(x.double().square().sum())
    assert sumsq == pytest.approx(want, rel=1e-6)
    # The scale from it is the exact (float64) scale to float32 rounding; torch's float32
    # norm (the reference's sign_scale) is itself off by ~1.5e-6 at 196621 elements.
    scale = float(kernels.pack_signs_scaled(x)[1])
    assert scale == pytest.approx(math.sqrt(want / n), rel=2e-7)
    assert scale == pytest.approx(float(signs.sign_scale(x)), rel=1e-5)


@pytest.mark.parametrize("n", SIZES)
def test_unpack_writes_exactly_plus_minus_scale(simd: str, n: int) -> None:
    x = _data(n, n + 1)
    packed = signs.pack_signs(x)
    scale = 0.3125
    out = torch.full((n,), 7.0)
    znative.unpack_signs(packed.numpy(), scale, out.numpy())
    want = signs.unpack_signs(packed, n) * scale
    assert torch.equal(_bits(out), _bits(want))


def test_sign_bits_match_numpy_packbits_for_special_values() -> None:
    x = torch.tensor(SPECIAL * 3 + [-2.0, 3.0, -0.5])  # 27 elements: a partial last byte
    out = torch.empty(signs.packed_bytes(x.numel()), dtype=torch.uint8)
    znative.pack_signs(x.numpy(), out.numpy())
    not_negative = ~(x < 0)  # -0.0 and NaN count as not negative
    assert out.numpy().tolist() == np.packbits(not_negative.numpy()).tolist()


def test_sign_kernels_refuse_bad_buffers_without_writing() -> None:
    out = torch.full((1,), 5, dtype=torch.uint8)
    with pytest.raises(znative.ShapeMismatchError, match=r"out has 1 elements.*n = 9"):
        znative.pack_signs(torch.ones(9).numpy(), out.numpy())
    assert out.item() == 5
    with pytest.raises(znative.DTypeError, match="x: expected float32"):
        znative.pack_signs(torch.ones(8, dtype=torch.float64).numpy(), out.numpy())
    vals = torch.full((17,), 3.0)
    with pytest.raises(znative.ShapeMismatchError, match="packed"):
        znative.unpack_signs(torch.zeros(2, dtype=torch.uint8).numpy(), 1.0, vals.numpy())
    assert torch.equal(vals, torch.full((17,), 3.0))


# ---- blockwise INT8 / INT4 ---------------------------------------------------------------

BLOCK_CASES = [(0, 4), (1, 2), (7, 4), (33, 16), (1000, 256), (PART + 300, 2048), (3 * PART + 1, 6)]


def _block_data(n: int, block: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    if n > 4 * block:
        x[block : 2 * block] = 0.0  # an all-zero block: scale 1
        x[2 * block + 1] = float("nan")  # non-finite blocks: scale NaN
        x[3 * block] = -float("inf")
        x[-1] = -0.0
    return x


def _native_quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    codes = torch.full((blockquant.code_bytes(n, bits),), 0xEE, dtype=torch.uint8)
    scales = torch.full((blockquant.num_blocks(n, block),), -5.0)
    znative.quantize_blocks(x.numpy(), codes.numpy(), scales.numpy(), bits=bits, block=block)
    return codes, scales


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("n", "block"), BLOCK_CASES)
def test_block_quantize_matches_reference_bits(simd: str, bits: int, n: int, block: int) -> None:
    x = _block_data(n, block, n + bits)
    want_codes, want_scales = blockquant.quantize_blocks(x, bits, block)
    codes, scales = _native_quantize(x, bits, block)
    assert torch.equal(codes, want_codes)
    assert torch.equal(_bits(scales), _bits(want_scales))

    out = torch.full((n,), 9.0)
    znative.dequantize_blocks(codes.numpy(), scales.numpy(), out.numpy(), bits=bits, block=block)
    want = blockquant.dequantize_blocks(want_codes, want_scales, bits, block, n)
    assert torch.equal(_bits(out), _bits(want))


@pytest.mark.parametrize("bits", [8, 4])
def test_block_round_trip_error_is_half_a_step(bits: int) -> None:
    n, block = 10_000, 256
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits)) * 5
    codes, scales = _native_quantize(x, bits, block)
    y = torch.empty(n)
    znative.dequantize_blocks(codes.numpy(), scales.numpy(), y.numpy(), bits=bits, block=block)
    step_N = scales.repeat_interleave(block)[:n]
    assert bool(((x - y).abs() <= step_N / 2 * (1 + 1e-6)).all())


def test_block_kernels_refuse_bad_parameters_and_buffers() -> None:
    x = torch.ones(9)
    with pytest.raises(znative.HyperparameterError, match="bits = 3"):
        znative.quantize_blocks(
            x.numpy(), np.zeros(9, np.uint8), np.zeros(1, np.float32), bits=3, block=16
        )
    with pytest.raises(znative.HyperparameterError, match=r"block = 7.*even for INT4"):
        znative.quantize_blocks(
            x.numpy(), np.zeros(5, np.uint8), np.zeros(2, np.float32), bits=4, block=7
        )
    codes = np.full(4, 3, np.uint8)
    with pytest.raises(znative.ShapeMismatchError, match=r"codes has 4 elements.*n = 9"):
        znative.quantize_blocks(x.numpy(), codes, np.zeros(2, np.float32), bits=4, block=8)
    assert codes.tolist() == [3, 3, 3, 3]
    with pytest.raises(znative.DTypeError, match="scales: expected dtype float32"):
        znative.dequantize_blocks(
            np.zeros(9, np.uint8), np.zeros(1), np.zeros(9, np.float32), bits=8, block=16
        )


# ---- GPU twins (.cu) ---------------------------------------------------------------------


@pytest.fixture()
def cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
def test_cuda_signs_match_reference(cuda: None, n: int) -> None:
    x = _data(n, n)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        packed, scale = kernels.pack_signs_scaled(xd.cuda())
        assert torch.equal(packed.cpu(), signs.pack_signs(xd)), dtype
    finite = _data(n, n, special=False)
    _, scale = kernels.pack_signs_scaled(finite.cuda())
    exact = math.sqrt(float(finite.double().square().sum()) / n) if n else 0.0
    assert float(scale) == pytest.approx(exact, rel=2e-7)
    packed = signs.pack_signs(x)
    out = kernels.unpack_signs_scaled(packed.cuda(), n, 0.3125)
    assert torch.equal(_bits(out.cpu()), _bits(signs.unpack_signs(packed, n) * 0.3125))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("n", "block"), BLOCK_CASES)
def test_cuda_block_quant_matches_reference(cuda: None, bits: int, n: int, block: int) -> None:
    x = _block_data(n, block, n + bits)
    want_codes, want_scales = blockquant.quantize_blocks(x, bits, block)
    codes, scales = kernels.quantize_blocks(x.cuda(), bits, block)
    assert torch.equal(codes.cpu(), want_codes)
    assert torch.equal(_bits(scales.cpu()), _bits(want_scales))
    out = kernels.dequantize_blocks(codes, scales, bits, block, n)
    want = blockquant.dequantize_blocks(want_codes, want_scales, bits, block, n)
    # Exact, NaN where the reference has NaN (the GPU's NaN * 0 is its canonical NaN, not
    # the CPU's propagated payload, so NaN bit patterns differ).
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0, equal_nan=True)
