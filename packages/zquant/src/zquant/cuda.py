"""GPU dequantize and dequantize-GEMV of packed INT4 / FP6 weights (``quant_dequant.cu``).

The kernels read :class:`zquant.quantizers.QuantizedWeight` buffers as they are
(INT4 nibbles, FP6 4+2 planes, float32 scales), so a weight moved to the GPU
with ``.to("cuda")`` on its tensors needs no repacking. The reference is
:func:`zquant.quantizers.dequantize_weight`; ``tests/zquant/test_cuda.py`` checks
both kernels against it on a GPU, and ``tests/znative/test_cuda_nvrtc.py``
compile-checks the source everywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from znative.cuda import i32
from zquant.quantizers import QuantizedWeight, group_geometry

_MODULE = "quant_dequant"
_THREADS = 128  # QD_THREADS in the .cu
_WARPS = _THREADS // 32


def _check(qw: QuantizedWeight) -> tuple[str, int]:
    spec = qw.spec
    if not qw.data.is_cuda:
        raise ValueError(f"packed weight is on {qw.data.device}; move its tensors to CUDA first")
    if spec.fmt == "fp6":
        return "fp6", 0
    if spec.fmt == "int" and 3 <= spec.bits <= 4:
        return "int4", (2 ** (spec.bits - 1) if spec.symmetric else 0)
    raise ValueError(
        f"the CUDA dequantize kernels take int3/int4 or fp6 weights, got {spec.describe()}"
    )


def _common(qw: QuantizedWeight) -> tuple[int, int, int, int]:
    n, k = qw.shape
    group, _ = group_geometry(qw.spec, k)
    return n, k, group, qw.scale.shape[0]


def _weight_args(qw: QuantizedWeight, fmt: str, offset: int) -> tuple[object, ...]:
    scale = qw.scale.float().contiguous()
    if fmt == "fp6":
        assert qw.data2 is not None
        return (qw.data.contiguous(), qw.data2.contiguous(), scale)
    zero = scale if qw.zero is None else qw.zero.float().contiguous()  # unread when has_zero == 0
    return (qw.data.contiguous(), scale, zero, i32(qw.zero is not None), i32(offset))


def dequantize_cuda(qw: QuantizedWeight) -> Tensor:
    """float32 ``(out, in)`` on the weight's device, equal to ``dequantize_weight(qw)``."""
    import znative.cuda

    fmt, offset = _check(qw)
    n, k, group, scale_rows = _common(qw)
    out = torch.empty(n, k, dtype=torch.float32, device=qw.data.device)
    if out.numel() == 0:
        return out
    blocks = min((out.numel() + 255) // 256, 65535)
    znative.cuda.launch(
        _MODULE,
        f"dequant_{fmt}_f32",
        blocks,
        256,
        (
            out,
            *_weight_args(qw, fmt, offset),
            i32(n),
            i32(k),
            i32(group),
            i32(scale_rows),
        ),
        stream=torch.cuda.current_stream(out.device).cuda_stream,
        device=out.device.index,
    )
    return out


def dequant_gemv_cuda(x: Tensor, qw: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """``x (m, in) @ dequant(qw)^T + bias`` as float32 ``(m, out)``, reading packed weights directly.

    Meant for decode-sized ``m`` (a warp per output and token); large ``m`` is better
    served by :func:`dequantize_cuda` and a GEMM.
    """
    import znative.cuda

    fmt, offset = _check(qw)
    n, k, group, scale_rows = _common(qw)
    if x.shape[-1] != k:
        raise ValueError(
            f"x has {x.shape[-1]} features but the weight is {qw.shape}; pass (m, {k})"
        )
    x32 = x.reshape(-1, k).float().contiguous()
    m = x32.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x32.device)
    if out.numel() == 0:
        return out
    b = out if bias is None else bias.float().contiguous()  # unread when has_bias == 0
    znative.cuda.launch(
        _MODULE,
        f"{fmt}_gemv_f32",
        ((n + _WARPS - 1) // _WARPS, m),
        _THREADS,
        (
            out,
            x32,
            *_weight_args(qw, fmt, offset),
            b,
            i32(bias is not None),
            i32(m),
            i32(n),
            i32(k),
            i32(group),
            i32(scale_rows),
        ),
        stream=torch.cuda.current_stream(out.device).cuda_stream,
        device=out.device.index,
    )
    return out
