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
"""

from __future__ import annotations

import os as _os

from znative._native import (
    DTypeError,
    HyperparameterError,
    LayoutError,
    ShapeMismatchError,
    SimdError,
    __version__,
    adagrad_step,
    adam_step,
    detected_simd_level,
    lion_step,
    num_threads,
    set_simd_level,
    simd_level,
    stream_4r3w,
)

__all__ = [
    "DTypeError",
    "HyperparameterError",
    "LayoutError",
    "ShapeMismatchError",
    "SimdError",
    "__version__",
    "adagrad_step",
    "adam_step",
    "detected_simd_level",
    "lion_step",
    "num_threads",
    "set_simd_level",
    "simd_level",
    "stream_4r3w",
]

_requested = _os.environ.get("ZNATIVE_SIMD")
if _requested:
    # Validate once at import so a typo or an unsupported level is an error, not a silent fallback.
    set_simd_level(_requested)
