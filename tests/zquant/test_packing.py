"""Bit packing: exact round trips, FP6 e3m2 covering all 64 codes, the 4+2 split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zquant.packing import (
    FP6_MAX,
    FP6_VALUES,
    fp6_decode,
    fp6_encode,
    pack_bits,
    pack_fp6,
    pack_int4,
    packed_length,
    unpack_bits,
    unpack_fp6,
    unpack_int4,
)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([1, 2, 4, 8]),
    rows=st.integers(1, 5),
    n=st.integers(1, 67),
    seed=st.integers(0, 99),
)
def test_pack_bits_round_trip_exact(bits: int, rows: int, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, n), generator=g, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (rows, packed_length(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_int4_layout_first_element_in_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 3]], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x21, 0x03]]
    assert torch.equal(unpack_int4(packed, 3), codes)


def test_pack_rejects_codes_too_wide() -> None:
    with pytest.raises(ValueError, match="does not fit in 4 bits"):
        pack_int4(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="cannot be packed"):
        pack_bits(torch.tensor([1], dtype=torch.uint8), 3)


def test_fp6_all_64_codes_round_trip_and_match_definition() -> None:
    codes = torch.arange(64, dtype=torch.uint8)
    values = fp6_decode(codes)
    # The bit-move decode equals the value computed from sign/exponent/mantissa.
    assert torch.equal(values, FP6_VALUES)
    assert torch.equal(fp6_encode(values), codes)
    assert values[31].item() == FP6_MAX and values[63].item() == -FP6_MAX
    assert values[1].item() == 0.0625  # smallest subnormal, 1/4 * 2**(1-3)
    assert values[4].item() == 0.25  # smallest normal, 2**(1-3)
    assert torch.signbit(values[32]) and values[32].item() == 0.0  # -0.0 is its own code


def test_fp6_encode_saturates_rounds_to_nearest_even_and_keeps_sign_of_zero() -> None:
    x = torch.tensor(
        [1e9, -1e9, float("inf"), 0.0, -0.0, -1e-6, 0.03125, 0.09375, 1.125, 1.375, 27.0]
    )
    got = fp6_decode(fp6_encode(x))
    # 0.03125 is halfway between 0 (code 0, even) and 0.0625 (code 1): ties go to even.
    # 0.09375 is halfway between 0.0625 (code 1) and 0.125 (code 2): to 0.125.
    # 1.125 between 1.0 (code 12) and 1.25 (13): to 1.0; 1.375 between 1.25 and 1.5 (14): to 1.5.
    want = torch.tensor([28.0, -28.0, 28.0, 0.0, -0.0, -0.0, 0.0, 0.125, 1.0, 1.5, 28.0])
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    with pytest.raises(ValueError, match="NaN"):
        fp6_encode(torch.tensor([float("nan")]))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), scale=st.floats(0.01, 40.0))
def test_fp6_encode_is_nearest(seed: int, scale: float) -> None:
    x = torch.randn(257, generator=torch.Generator().manual_seed(seed)) * scale
    got = fp6_decode(fp6_encode(x))
    clipped = x.clamp(-FP6_MAX, FP6_MAX)
    best = (clipped[:, None] - FP6_VALUES[None, :]).abs().amin(dim=1)
    assert torch.equal((got - clipped).abs(), best)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 41), seed=st.integers(0, 99))
def test_fp6_4_plus_2_split_round_trip(rows: int, n: int, seed: int) -> None:
    codes = torch.randint(
        0, 64, (rows, n), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )
    plane4, plane2 = pack_fp6(codes)
    assert plane4.shape == (rows, (n + 1) // 2) and plane2.shape == (rows, (n + 3) // 4)
    assert torch.equal(unpack_fp6(plane4, plane2, n), codes)
    # A kernel's shift-and-mask rebuild of element k.
    k = n - 1
    p4 = plane4[:, k // 2].to(torch.int32)
    p2 = plane2[:, k // 4].to(torch.int32)
    rebuilt = (((p2 >> (2 * (k % 4))) & 3) << 4) | ((p4 >> (4 * (k % 2))) & 15)
    assert torch.equal(rebuilt.to(torch.uint8), codes[:, k])
