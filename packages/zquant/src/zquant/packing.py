"""Bit packing of quantized codes: INT4 nibbles, 1/2-bit planes, FP6 e3m2 and its 4+2 split.

Every function works on the last dimension and keeps leading dimensions, so a
``(out, in)`` weight packs row by row and a kernel can walk a row's bytes in
order. Within a byte the *first* element sits in the *lowest* bits:

* INT4, two per byte: element ``2j`` in bits 0-3, ``2j+1`` in bits 4-7.
* 2-bit codes (ternary, the FP6 high plane), four per byte: element ``4j+i`` in
  bits ``2i..2i+1``.
* 1-bit codes (binary), eight per byte: element ``8j+i`` in bit ``i``.

A row whose length is not a multiple of the per-byte count is padded with the
code 0; the caller passes the true length back to the unpack functions.

FP6 e3m2 (1 sign, 3 exponent, 2 mantissa bits) uses **exponent bias 3**, no
infinities and no NaN (all 64 codes are finite numbers), as in FP6-LLM: the
largest magnitude is ``2**4 * 1.75 = 28``, the smallest normal ``2**-2 = 0.25``,
subnormals are ``m/4 * 2**-2`` (0.0625, 0.125, 0.1875). Bias 3 is chosen
because it makes decoding a pure bit move: put the low five bits of the code
into bits 21-25 of a float32 (exponent's low 3 bits and mantissa's top 2 bits),
the sign into bit 31, and multiply by ``2**124`` (= ``2**(127-3)``); subnormals
come out right because float32 subnormals scale the same way. Encoding rounds
to nearest, ties to even, saturates at ±28 and keeps the sign of -0.0.

The 4+2 split stores each 6-bit code ``s e2 e1 e0 m1 m0`` as its top two bits
``s e2`` in a 2-bit plane and its low four bits ``e1 e0 m1 m0`` in a 4-bit
plane, so a kernel rebuilds it with ``((p2 >> 2i) & 3) << 4 | ((p4 >> 4i) & 15)``
from aligned byte loads (FP6-LLM stores the segments separately for the same
reason: no 6-bit unaligned reads).
"""

from __future__ import annotations

import torch
from torch import Tensor

FP6_BIAS = 3
"""Exponent bias of our FP6 e3m2 format."""
FP6_MAX = 28.0
"""Largest finite FP6 e3m2 magnitude with bias 3 (``2**4 * 1.75``)."""

_PER_BYTE = {1: 8, 2: 4, 4: 2, 8: 1}


def _check_codes(codes: Tensor, bits: int, what: str) -> None:
    if codes.dtype != torch.uint8:
        raise TypeError(
            f"{what}: codes must be torch.uint8, got {codes.dtype}; cast with .to(torch.uint8)"
        )
    if codes.numel() and int(codes.max()) >= (1 << bits):
        raise ValueError(
            f"{what}: code {int(codes.max())} does not fit in {bits} bits (max {(1 << bits) - 1}); "
            "mask or clamp the codes before packing"
        )


def packed_length(n: int, bits: int) -> int:
    """Bytes per row that hold ``n`` codes of ``bits`` bits (1, 2, 4 or 8)."""
    if bits not in _PER_BYTE:
        raise ValueError(f"bits={bits} cannot be packed; use one of {sorted(_PER_BYTE)}")
    per = _PER_BYTE[bits]
    return (n + per - 1) // per


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Packs unsigned ``bits``-bit codes ``(..., n)`` into bytes ``(..., ceil(n*bits/8))``."""
    packed_length(0, bits)  # validates bits
    _check_codes(codes, bits, f"pack_bits(bits={bits})")
    per = _PER_BYTE[bits]
    if per == 1:
        return codes.contiguous().clone()
    n = codes.shape[-1]
    pad = (-n) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    grouped = codes.reshape(*codes.shape[:-1], -1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: bytes ``(..., m)`` to ``n`` codes ``(..., n)`` (uint8)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits: packed must be torch.uint8, got {packed.dtype}")
    need = packed_length(n, bits)
    if packed.shape[-1] != need:
        raise ValueError(
            f"unpack_bits: {n} codes of {bits} bits need {need} bytes per row, got {packed.shape[-1]}; "
            "pass the unpadded length the codes were packed from"
        )
    per = _PER_BYTE[bits]
    if per == 1:
        return packed.clone()
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)


def pack_int4(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte, first in the low nibble: ``(..., n)`` to ``(..., ceil(n/2))``."""
    return pack_bits(codes, 4)


def unpack_int4(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_int4`."""
    return unpack_bits(packed, 4, n)


def _fp6_table() -> Tensor:
    """Float32 values of the 64 codes, computed from the definition (not by bit tricks)."""
    vals = []
    for code in range(64):
        sign = -1.0 if code & 0x20 else 1.0
        exp = (code >> 2) & 0x7
        man = code & 0x3
        mag = (
            (man / 4.0) * 2.0 ** (1 - FP6_BIAS)
            if exp == 0
            else (1.0 + man / 4.0) * 2.0 ** (exp - FP6_BIAS)
        )
        vals.append(sign * mag)
    return torch.tensor(vals, dtype=torch.float32)


FP6_VALUES: Tensor = _fp6_table()
"""``FP6_VALUES[c]`` is the value of code ``c`` (index 32 is -0.0)."""


def fp6_decode(codes: Tensor) -> Tensor:
    """FP6 e3m2 codes (uint8, 0..63) to float32 by shifting bits into a float32 and rescaling."""
    _check_codes(codes, 6, "fp6_decode")
    c = codes.to(torch.int32)
    bits = ((c & 0x20) << 26) | ((c & 0x1F) << 21)
    return bits.view(torch.float32) * (2.0**124)


def fp6_encode(x: Tensor) -> Tensor:
    """Float tensor to FP6 e3m2 codes (uint8): nearest value, ties to even, saturating at ±28.

    NaN has no FP6 code and raises ``ValueError``; ±inf saturate to ±28.
    """
    x = x.to(torch.float32)
    if torch.isnan(x).any():
        raise ValueError(
            "fp6_encode: input has NaN, which FP6 e3m2 cannot represent; clean the weights first"
        )
    mag = x.abs().clamp(max=FP6_MAX)
    pos = FP6_VALUES[:32].to(x.device)  # increasing in the code
    hi = torch.searchsorted(pos, mag.contiguous()).clamp(max=31)  # first value >= mag
    lo = (hi - 1).clamp(min=0)
    d_hi = pos[hi] - mag
    d_lo = mag - pos[lo]
    # Tie: pick the even code (an even mantissa), IEEE round-half-to-even.
    take_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0))
    code = torch.where(take_lo, lo, hi)
    sign = torch.signbit(x).to(torch.int64) << 5
    return (code | sign).to(torch.uint8)


def pack_fp6(codes: Tensor) -> tuple[Tensor, Tensor]:
    """Splits 6-bit codes ``(..., n)`` into a 4-bit plane ``(..., ceil(n/2))`` (low bits
    ``e1 e0 m1 m0``) and a 2-bit plane ``(..., ceil(n/4))`` (high bits ``s e2``)."""
    _check_codes(codes, 6, "pack_fp6")
    return pack_bits(codes & 0xF, 4), pack_bits(codes >> 4, 2)


def unpack_fp6(plane4: Tensor, plane2: Tensor, n: int) -> Tensor:
    """Rebuilds the 6-bit codes ``(..., n)`` from the planes of :func:`pack_fp6`."""
    return (unpack_bits(plane2, 2, n) << 4) | unpack_bits(plane4, 4, n)
