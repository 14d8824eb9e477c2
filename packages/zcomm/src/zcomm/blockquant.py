"""Blockwise symmetric INT8 / INT4 quantization for collectives: the readable torch reference.

ZeRO++ sends weights (qwZ) and gradients (qgZ) as integer codes with one fp32 scale per block
of ``block`` consecutive elements (DeepSpeed's ``ds_quantizer`` / ``swizzle_quant`` work on
groups the same way). A tensor is read flat; its ``n`` elements fall into
``ceil(n / block)`` blocks, the last one possibly short.

Per block ``b`` with ``qmax = 2**(bits-1) - 1`` (127 for INT8, 7 for INT4)::

    scale[b] = max|x[b]| / qmax            (1.0 where that is 0: an all-zero block)
    level    = clamp(round_half_even(x / scale[b]), -qmax, qmax)
    code     = level + 2**(bits-1)          (offset binary: 128 / 8 is zero)

- ``x / scale`` is a true division (not a multiply by ``1 / scale``), so the native kernel
  (``znative.comm_quantize_blocks``) gives the same codes bit for bit.
- A block holding a NaN or an infinity gets ``scale = NaN`` and all-zero levels, so it
  dequantizes to NaN throughout: an fp16 overflow in a gradient still shows after the
  collective instead of being rounded away.
- INT8 codes are one byte each (``n`` bytes). INT4 codes are packed two per byte, the
  *first* element in the *low* nibble (``zquant.packing.pack_int4``'s order and offset, so
  ``zquant.packing.unpack_int4`` reads them): ``ceil(n / 2)`` bytes, the unused high nibble of
  an odd last byte is 0. INT4 needs an even ``block`` so every block starts on a byte.

Dequantization is ``(code - 2**(bits-1)) * scale`` in float32, then a cast to the requested
dtype. The round-trip error per element is at most ``scale / 2 = max|x[b]| / (2 * qmax)`` of
its block (plus the final cast's rounding).

This module is the reference; :mod:`zcomm.kernels` picks the native kernel when it can.
"""

from __future__ import annotations

import torch

BITS = (4, 8)
"""Supported code widths."""


def qmax(bits: int) -> int:
    """Largest level magnitude for ``bits``-bit symmetric codes (127 for 8, 7 for 4)."""
    return (1 << (bits - 1)) - 1


def num_blocks(numel: int, block: int) -> int:
    """Blocks (and scales) of ``numel`` elements cut into ``block``-sized blocks."""
    return (numel + block - 1) // block


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of codes for ``numel`` elements: ``numel`` for INT8, ``ceil(numel / 2)`` for INT4."""
    return numel if bits == 8 else (numel + 1) // 2


def check_params(bits: int, block: int) -> None:
    """Raises ``ValueError`` naming ``bits`` / ``block`` when they are not a supported pair."""
    if bits not in BITS:
        raise ValueError(f"bits={bits} is not supported for block quantization; use 8 or 4")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive int (e.g. 256 or 2048)")
    if bits == 4 and block % 2:
        raise ValueError(
            f"block={block} is odd; INT4 packs two codes per byte, so use an even block "
            "size so every block starts on a byte"
        )


def _check_float(x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"block quantization takes a floating-point tensor, got {x.dtype}")


def quantize_blocks(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape and float dtype, read flat) as ``(codes, scales)``.

    ``codes`` is uint8 of :func:`code_bytes` bytes, ``scales`` float32 of :func:`num_blocks`
    entries, both on ``x``'s device. See the module docstring for the exact rule.
    """
    check_params(bits, block)
    _check_float(x)
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    nb = num_blocks(n, block)
    q = qmax(bits)
    pad = nb * block - n
    blocks_BK = (
        torch.cat([flat, flat.new_zeros(pad)]).view(nb, block) if pad else flat.view(nb, block)
    )
    finite_B = blocks_BK.isfinite().all(dim=1)
    absmax_B = blocks_BK.abs().amax(dim=1)
    scales_B = absmax_B / q
    # 1 where absmax / qmax is 0: an all-zero block, or one so tiny the division underflows.
    scales_B = torch.where(scales_B > 0, scales_B, torch.ones_like(scales_B))
    scales_B = torch.where(finite_B, scales_B, torch.full_like(scales_B, float("nan")))
    levels_BK = torch.round(blocks_BK / scales_B[:, None]).clamp_(-q, q)
    levels_BK = torch.where(finite_B[:, None], levels_BK, torch.zeros_like(levels_BK))
    codes_N = (levels_BK.reshape(-1)[:n] + (q + 1)).to(torch.uint8)
    if bits == 8:
        return codes_N, scales_B
    if n % 2:
        codes_N = torch.cat([codes_N, codes_N.new_zeros(1)])
    pairs_P2 = codes_N.view(-1, 2)
    return pairs_P2[:, 0] | (pairs_P2[:, 1] << 4), scales_B


def dequantize_blocks(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The flat ``numel``-element tensor of ``dtype`` that :func:`quantize_blocks` encoded."""
    check_params(bits, block)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be torch.uint8, got {codes.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"scales must be torch.float32, got {scales.dtype}")
    want_codes, want_scales = code_bytes(numel, bits), num_blocks(numel, block)
    if codes.numel() != want_codes or scales.numel() != want_scales:
        raise ValueError(
            f"numel={numel} at bits={bits}, block={block} needs {want_codes} code bytes and "
            f"{want_scales} scales, got {codes.numel()} and {scales.numel()}"
        )
    flat = codes.reshape(-1)
    if bits == 4:
        flat = torch.stack([flat & 0xF, flat >> 4], dim=1).reshape(-1)[:numel]
    levels_N = flat.to(torch.float32) - (qmax(bits) + 1)
    pad = want_scales * block - numel
    if pad:
        levels_N = torch.cat([levels_N, levels_N.new_zeros(pad)])
    values_BK = levels_N.view(want_scales, block) * scales.reshape(-1, 1)
    return values_BK.reshape(-1)[:numel].to(dtype)
