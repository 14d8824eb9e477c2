"""The fast path of zcomm's compression kernels: native where it applies, the torch reference otherwise.

Every function here computes what its reference computes — :mod:`zcomm.signs` for 1-bit
signs, :mod:`zcomm.blockquant` for blockwise INT8 / INT4 — and picks the implementation per
call from the tensor:

- CPU ``float32`` (and ``bfloat16`` for :func:`pack_signs_scaled`): znative's Rust kernels
  (``znative.pack_signs`` & co.: runtime SIMD dispatch, multithreaded over large tensors);
- CUDA ``float32`` / ``bfloat16`` with CuPy installed: the NVRTC-compiled twins in
  ``znative/cuda/kernels/comm_signs.cu`` and ``comm_blockquant.cu``, launched on torch's
  current stream;
- anything else (another dtype, no znative, no CuPy): the torch reference.

The packed signs, the block codes and scales, and the unpacked / dequantized values are
bit-identical across the three paths (``tests/znative/test_comm_kernels.py``). The one value
that is not is the fused scale of :func:`pack_signs_scaled`: its sum of squares is added in
another order than ``torch.linalg.norm``'s (per-lane float32 runs of 1024 elements added in
float64), so it is the exact scale to float32 rounding but not :func:`zcomm.signs.sign_scale`
bit for bit (torch's float32 reduction is itself ~1e-6 relative off at 200k elements). Code that must match the reference exactly (the
compressed all-reduce, checked against ``zcomm.reference``) takes the scale from
``sign_scale`` and only the bits from here.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch

from zcomm import blockquant, signs

_CUDA_THREADS = 256  # CS_THREADS / CQ_THREADS in the .cu sources
_MAX_GRID = 65535


def _load_native() -> ModuleType | None:
    try:
        import znative
    except ImportError:
        return None
    if not hasattr(znative, "pack_signs"):  # a wheel built before these kernels existed
        return None
    return znative


_native = _load_native()


def native_available() -> bool:
    """Whether znative's CPU kernels for compressed collectives are installed."""
    return _native is not None


def _cuda_ok(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    try:
        import znative.cuda
    except ImportError:
        return False
    return znative.cuda.cupy_status()[0]


def _launch(
    module: str, kernel: str, grid: int, args: tuple[Any, ...], device: torch.device
) -> None:
    import znative.cuda

    znative.cuda.launch(
        module,
        kernel,
        max(1, min(grid, _MAX_GRID)),
        _CUDA_THREADS,
        args,
        stream=torch.cuda.current_stream(device).cuda_stream,
        device=device.index,
    )


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).contiguous()


def _as_array(t: torch.Tensor) -> Any:
    """A numpy view of a contiguous CPU tensor (bfloat16 as its int16 bits)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


# ---- 1-bit signs -------------------------------------------------------------------------


def pack_signs_scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scale)``: ``x``'s signs as :func:`zcomm.signs.pack_signs` packs them, and
    ``||x|| / sqrt(n)`` as a 0-d tensor of ``x``'s dtype (0 for an empty tensor), from one pass
    over ``x`` on the native paths."""
    flat = _flat(x)
    n = flat.numel()
    packed = torch.empty(signs.packed_bytes(n), dtype=torch.uint8, device=flat.device)
    fast = flat.dtype in (torch.float32, torch.bfloat16)
    if fast and flat.device.type == "cpu" and _native is not None:
        sumsq = _native.pack_signs(_as_array(flat), packed.numpy())
        scale = math.sqrt(sumsq / n) if n else 0.0
        return packed, torch.tensor(scale, dtype=x.dtype)
    if fast and _cuda_ok(flat):
        sumsq_t = torch.zeros(1, dtype=torch.float64, device=flat.device)
        if n:
            kernel = (
                "comm_pack_signs_f32" if flat.dtype == torch.float32 else "comm_pack_signs_bf16"
            )
            data = flat if flat.dtype == torch.float32 else flat.view(torch.int16)
            grid = math.ceil(packed.numel() / _CUDA_THREADS)
            _launch("comm_signs", kernel, grid, (packed, sumsq_t, data, _i64(n)), flat.device)
        scale_t = (sumsq_t / n).sqrt() if n else sumsq_t.new_zeros(1)
        return packed, scale_t.reshape(()).to(x.dtype)
    return signs.pack_signs(flat), signs.sign_scale(flat)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """:func:`zcomm.signs.pack_signs`, bit for bit, on the fastest path for ``x``."""
    return pack_signs_scaled(x)[0]


def unpack_signs_scaled(
    packed: torch.Tensor, n: int, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The first ``n`` signs in ``packed`` as ``+scale`` / ``-scale``: bit for bit
    ``zcomm.signs.unpack_signs(packed, n) * scale`` in float32, then cast to ``dtype``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed signs must be uint8, got {packed.dtype}")
    want = signs.packed_bytes(n)
    if packed.numel() < want:
        raise ValueError(f"{packed.numel()} packed bytes hold {packed.numel() * 8} signs, not {n}")
    s = float(scale)
    flat = _flat(packed)[:want]
    if flat.device.type == "cpu" and _native is not None:
        out = torch.empty(n, dtype=torch.float32)
        _native.unpack_signs(flat.numpy(), s, out.numpy())
        return out.to(dtype)
    if _cuda_ok(flat):
        out = torch.empty(n, dtype=torch.float32, device=flat.device)
        if n:
            grid = math.ceil(n / _CUDA_THREADS)
            args = (out, flat, _f32(s), _i64(n))
            _launch("comm_signs", "comm_unpack_signs_f32", grid, args, flat.device)
        return out.to(dtype)
    return signs.unpack_signs(flat, n).mul_(torch.tensor(s, dtype=torch.float32)).to(dtype)


def unpack_signs(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`zcomm.signs.unpack_signs`, bit for bit, on the fastest path."""
    return unpack_signs_scaled(packed, n, 1.0, dtype)


# ---- blockwise INT8 / INT4 ---------------------------------------------------------------


def quantize_blocks(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`zcomm.blockquant.quantize_blocks`, bit for bit: ``(codes uint8, scales float32)``."""
    blockquant.check_params(bits, block)
    flat = _flat(x)
    native = _native if flat.device.type == "cpu" else None
    if flat.dtype != torch.float32 or not (native is not None or _cuda_ok(flat)):
        return blockquant.quantize_blocks(flat, bits, block)
    n = flat.numel()
    codes = torch.empty(blockquant.code_bytes(n, bits), dtype=torch.uint8, device=flat.device)
    scales = torch.empty(blockquant.num_blocks(n, block), dtype=torch.float32, device=flat.device)
    if native is not None:
        native.quantize_blocks(flat.numpy(), codes.numpy(), scales.numpy(), bits=bits, block=block)
    elif n:
        args = (codes, scales, flat, _i64(n), _i32(block), _i32(bits))
        _launch("comm_blockquant", "comm_quantize_blocks_f32", scales.numel(), args, flat.device)
    return codes, scales


def dequantize_blocks(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    block: int,
    numel: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """:func:`zcomm.blockquant.dequantize_blocks`, bit for bit."""
    blockquant.check_params(bits, block)
    native = _native if codes.device.type == "cpu" else None
    types_ok = codes.dtype == torch.uint8 and scales.dtype == torch.float32
    if not types_ok or not (native is not None or _cuda_ok(codes)):
        return blockquant.dequantize_blocks(codes, scales, bits, block, numel, dtype)
    c, s = _flat(codes), _flat(scales)
    want_c, want_s = blockquant.code_bytes(numel, bits), blockquant.num_blocks(numel, block)
    if c.numel() != want_c or s.numel() != want_s:  # the reference raises the full message
        return blockquant.dequantize_blocks(codes, scales, bits, block, numel, dtype)
    out = torch.empty(numel, dtype=torch.float32, device=c.device)
    if native is not None:
        native.dequantize_blocks(c.numpy(), s.numpy(), out.numpy(), bits=bits, block=block)
    elif numel:
        grid = math.ceil(numel / _CUDA_THREADS)
        args = (out, c, s, _i64(numel), _i32(block), _i32(bits))
        _launch("comm_blockquant", "comm_dequantize_blocks_f32", grid, args, c.device)
    return out.to(dtype)


def _i32(v: int) -> Any:
    from znative.cuda import i32  # numpy's sized scalars, through znative (zcomm imports no numpy)

    return i32(v)


def _i64(v: int) -> Any:
    from znative.cuda import i64

    return i64(v)


def _f32(v: float) -> Any:
    from znative.cuda import f32

    return f32(v)
