"""Blockwise INT8 / INT4 quantization for collectives: the torch reference's rule on hand-made
blocks, its layout (offset codes, INT4 low nibble first: zquant's packing), non-finite blocks,
the round-trip bound, clear errors, and the dispatching ``zcomm.kernels`` versions equal to it
bit for bit on every dtype and size."""

from __future__ import annotations

import pytest
import torch

from zcomm import blockquant, kernels
from zcomm.blockquant import code_bytes, dequantize_blocks, num_blocks, quantize_blocks
from zquant.packing import unpack_int4


def test_hand_computed_int8_block() -> None:
    x = torch.tensor([1.0, -0.5, 0.25, 0.0, -2.0, 4.0])  # blocks of 3: absmax 1.0 and 4.0
    codes, scales = quantize_blocks(x, 8, 3)
    assert torch.equal(scales, torch.tensor([1.0 / 127, 4.0 / 127]))
    levels = torch.tensor([127, -64, 32, 0, -64, 127])  # 63.5 and 31.75 round half to even
    assert torch.equal(codes.to(torch.int32) - 128, levels.to(torch.int32))
    y = dequantize_blocks(codes, scales, 8, 3, 6)
    assert torch.equal(y, (levels.float() * scales.repeat_interleave(3)))


def test_int4_packs_low_nibble_first_like_zquant() -> None:
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, 3.0])  # one block of 6 (short), absmax 7: scale 1
    codes, scales = quantize_blocks(x, 4, 6)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [(7 + 8) | ((-7 + 8) << 4), (1 + 8) | (8 << 4), 3 + 8]
    assert (unpack_int4(codes, 5).to(torch.int32) - 8).tolist() == [7, -7, 1, 0, 3]
    assert code_bytes(5, 4) == 3 and num_blocks(5, 6) == 1


def test_zero_and_non_finite_blocks() -> None:
    x = torch.zeros(12)
    x[4:8] = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    x[8:12] = torch.tensor([1.0, float("-inf"), 2.0, 3.0])
    for bits in (8, 4):
        codes, scales = quantize_blocks(x, bits, 4)
        assert scales[0].item() == 1.0  # all-zero block
        assert scales[1:].isnan().all()
        y = dequantize_blocks(codes, scales, bits, 4, 12)
        assert torch.equal(y[:4], torch.zeros(4))
        assert y[4:].isnan().all()  # an overflow stays visible after the collective


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [2, 64, 2048])
def test_round_trip_within_half_a_step(bits: int, block: int) -> None:
    n = 5000
    x = torch.randn(n, generator=torch.Generator().manual_seed(block)) * 3
    codes, scales = quantize_blocks(x, bits, block)
    assert codes.numel() == code_bytes(n, bits) and scales.numel() == num_blocks(n, block)
    y = dequantize_blocks(codes, scales, bits, block, n)
    step = scales.repeat_interleave(block)[:n]
    # |x - y| <= scale / 2 exactly; 1e-6 relative slack for the rounding of x / scale.
    assert bool(((x - y).abs() <= step / 2 * (1 + 1e-6)).all())


def test_other_dtypes_compute_in_float32_and_dequantize_to_any() -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    codes, scales = quantize_blocks(x.reshape(3, 100), 8, 128)
    want = quantize_blocks(x.float(), 8, 128)
    assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
    y = dequantize_blocks(codes, scales, 8, 128, 300, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (300,)


def test_bad_arguments_name_the_key_and_the_fix() -> None:
    x = torch.ones(8)
    with pytest.raises(ValueError, match=r"bits=3 is not supported.*use 8 or 4"):
        quantize_blocks(x, 3, 8)
    with pytest.raises(ValueError, match="block=0 must be a positive int"):
        quantize_blocks(x, 8, 0)
    with pytest.raises(ValueError, match=r"block=5 is odd.*even block size"):
        quantize_blocks(x, 4, 5)
    with pytest.raises(TypeError, match=r"floating-point tensor, got torch\.int32"):
        quantize_blocks(x.int(), 8, 8)
    codes, scales = quantize_blocks(x, 4, 4)
    with pytest.raises(ValueError, match="numel=9 at bits=4, block=4 needs 5 code bytes and 3"):
        dequantize_blocks(codes, scales, 4, 4, 9)
    with pytest.raises(TypeError, match=r"codes must be torch\.uint8"):
        dequantize_blocks(codes.to(torch.int8), scales, 4, 4, 8)


# ---- the dispatching versions ------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("n", "block"), [(0, 8), (13, 4), (70_001, 2048)])
def test_dispatch_equals_reference(dtype: torch.dtype, bits: int, n: int, block: int) -> None:
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 2).to(dtype)
    if n > 10:
        x[5] = float("nan")
    codes, scales = kernels.quantize_blocks(x, bits, block)
    want_codes, want_scales = quantize_blocks(x, bits, block)
    assert torch.equal(codes, want_codes)
    assert torch.equal(_bits(scales), _bits(want_scales))
    y = kernels.dequantize_blocks(codes, scales, bits, block, n, dtype)
    want = dequantize_blocks(want_codes, want_scales, bits, block, n, dtype)
    assert y.dtype == dtype and torch.equal(y.view(torch.uint8), want.view(torch.uint8))


def test_dispatch_uses_the_native_kernel_when_installed() -> None:
    # CI builds the wheel, so the fast path is the one tested above; say so if it is not.
    assert kernels.native_available(), "znative lacks quantize_blocks; run `make setup`"
    assert blockquant.BITS == (4, 8)
