"""1-bit compression: a float tensor's signs packed 8 to a byte, and the scale that goes with them.

A tensor ``x`` of ``n`` elements is sent as ``scale * sign(x)``: ``ceil(n / 8)`` bytes of
signs and one fp32 ``scale = ||x||_2 / sqrt(n)`` (DeepSpeed's 1-bit Adam,
``deepspeed/runtime/comm/compressed.py`` ``CompressedBackend.compressed_allreduce``:
``worker_scale = torch.linalg.norm(buffer_m) / np.sqrt(torch.numel(buffer_m))``). With that
scale the compressed tensor has the same L2 norm as ``x``.

Conventions, chosen to match DeepSpeed bit for bit:

- a bit is 1 where the element is *not negative*: DeepSpeed's ``x.sign().add_(1).bool()``
  maps ``+0.0``, ``-0.0`` and NaN to 1, so zeros decompress to ``+scale``;
- bits are packed most significant first (``numpy.packbits``/``cupy.packbits``' default
  order, which DeepSpeed's NCCL backend uses): element ``8*i + j`` is bit ``7 - j`` of
  byte ``i``; the unused low bits of a last partial byte are 0.
"""

from __future__ import annotations

import math

import torch

# (8,): the shift that puts element j of a byte's group at bit 7 - j.
_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)


def packed_bytes(n: int) -> int:
    """Bytes that hold ``n`` signs."""
    return (n + 7) // 8


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """The signs of ``x`` (any shape, read flat) as a uint8 tensor of ``ceil(n / 8)`` bytes."""
    flat = x.reshape(-1)
    n = flat.numel()
    bits_N = flat.lt(0).logical_not().to(torch.uint8)  # 1: not negative (DeepSpeed's rule)
    pad = packed_bytes(n) * 8 - n
    if pad:
        bits_N = torch.cat([bits_N, bits_N.new_zeros(pad)])
    shifts = _SHIFTS.to(flat.device)
    bits_B8 = bits_N.view(-1, 8)
    # The bits of one byte never overlap, so the sum of the shifted bits is their OR; it
    # fits in uint8 but torch sums integers in int64.
    return bits_B8.bitwise_left_shift(shifts).sum(dim=1).to(torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The first ``n`` signs in ``packed`` (uint8) as a flat tensor of ``+1`` / ``-1``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed signs must be uint8, got {packed.dtype}")
    if packed.numel() * 8 < n:
        raise ValueError(f"{packed.numel()} packed bytes hold {packed.numel() * 8} signs, not {n}")
    shifts = _SHIFTS.to(packed.device)
    bits_B8 = packed.reshape(-1, 1).bitwise_right_shift(shifts).bitwise_and_(1)
    bits_N = bits_B8.reshape(-1)[:n]
    return bits_N.to(dtype).mul_(2).sub_(1)


def sign_scale(x: torch.Tensor) -> torch.Tensor:
    """``||x||_2 / sqrt(n)`` as a 0-d tensor of ``x``'s dtype (0 for an empty tensor)."""
    n = x.numel()
    if n == 0:
        return x.new_zeros(())
    return torch.linalg.norm(x.reshape(-1)) / math.sqrt(n)


def signs(x: torch.Tensor) -> torch.Tensor:
    """``x``'s signs as ``+1`` / ``-1`` in its dtype and shape (0 counts as ``+1``) — what
    :func:`pack_signs` then :func:`unpack_signs` give back, without packing."""
    return x.lt(0).logical_not().to(x.dtype).mul_(2).sub_(1)
