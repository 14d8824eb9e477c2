"""znative: zstack's native core.

CPU kernels written in Rust (``znative._native``, built by maturin with
runtime SIMD dispatch) and CUDA kernel sources loaded through CuPy
(:mod:`znative.cuda`). Buffers cross as numpy arrays that view the caller's
memory (for torch, ``tensor.numpy()``; bfloat16 as ``tensor.view(torch.int16)``),
never copies. Every kernel releases the GIL and checks all of its arguments
before writing anything, so a rejected call leaves the buffers as they were.

Errors subclass builtins: :class:`ShapeMismatchError`,
:class:`HyperparameterError`, :class:`LayoutError` and :class:`SimdError` are
``ValueError``; :class:`DTypeError` is a ``TypeError``.

Async file IO (:class:`AioHandle`, :func:`aligned_buffer`,
:func:`io_backend_probe`) raises :class:`AioError`, an ``OSError`` with
``errno``, ``path`` and ``offset``; :class:`AioFileNotFoundError` and
:class:`AioPermissionError` also subclass ``FileNotFoundError`` /
``PermissionError``, and :class:`AioShortReadError` (``errno`` None) means the
file ended before the requested range.

Quantization kernels for zquant (:func:`int8_gemm`, :func:`int8_linear`,
:func:`int8_linear_split`, :func:`column_absmax`, :func:`quantize_tokenwise`, :func:`dequantize_weight`,
:func:`dequant_linear`) take int8/uint8/int32/float32 arrays in the layouts of ``zquant.packing``.

Compressed-collective kernels for zcomm (:func:`pack_signs`, :func:`unpack_signs`,
:func:`quantize_blocks`, :func:`dequantize_blocks`) read arrays flat, in the layouts of
``zcomm.signs`` and ``zcomm.blockquant`` (their torch references).

zserve's CPU forward kernels (:func:`rms_norm`, :func:`rotary_kv_write`,
:func:`paged_decode_attention`, :func:`linear_rows`) take float32 or bfloat16 (int16
view) arrays in the layouts of ``zserve.model`` (their torch references: ``llama.rms_norm``,
``llama.apply_rotary`` + ``KVCache.write``, ``attention.paged_attention_reference``).
"""

from __future__ import annotations

import os as _os

from znative._native import (
    AioError,
    AioFileNotFoundError,
    AioHandle,
    AioPermissionError,
    AioShortReadError,
    AlignedAllocation,
    DTypeError,
    HyperparameterError,
    LayoutError,
    ShapeMismatchError,
    SimdError,
    __version__,
    adagrad_step,
    adam_step,
    add_rms_norm,
    aligned_buffer,
    column_absmax,
    dequant_linear,
    dequantize_blocks,
    dequantize_weight,
    detected_simd_level,
    int8_gemm,
    int8_linear,
    int8_linear_split,
    int8_vnni_available,
    io_backend_probe,
    linear_rows,
    lion_step,
    num_threads,
    pack_signs,
    paged_decode_attention,
    quantize_blocks,
    quantize_tokenwise,
    rms_norm,
    rotary_kv_write,
    set_simd_level,
    simd_level,
    stream_4r3w,
    team_stats,
    unpack_signs,
)

__all__ = [
    "AioError",
    "AioFileNotFoundError",
    "AioHandle",
    "AioPermissionError",
    "AioShortReadError",
    "AlignedAllocation",
    "DTypeError",
    "HyperparameterError",
    "LayoutError",
    "ShapeMismatchError",
    "SimdError",
    "__version__",
    "adagrad_step",
    "adam_step",
    "add_rms_norm",
    "aligned_buffer",
    "column_absmax",
    "dequant_linear",
    "dequantize_blocks",
    "dequantize_weight",
    "detected_simd_level",
    "int8_gemm",
    "int8_linear",
    "int8_linear_split",
    "int8_vnni_available",
    "io_backend_probe",
    "linear_rows",
    "lion_step",
    "num_threads",
    "pack_signs",
    "paged_decode_attention",
    "quantize_blocks",
    "quantize_tokenwise",
    "rms_norm",
    "rotary_kv_write",
    "set_simd_level",
    "simd_level",
    "stream_4r3w",
    "team_stats",
    "unpack_signs",
]

_requested = _os.environ.get("ZNATIVE_SIMD")
if _requested:
    # Validate once at import so a typo or an unsupported level is an error, not a silent fallback.
    set_simd_level(_requested)
