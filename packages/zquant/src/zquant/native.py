"""Torch wrappers over the znative quantization kernels (CPU tensors in, CPU tensors out).

The kernels take numpy views of the tensors' memory (no copies) and release the
GIL; layouts are those of :mod:`zquant.packing` and
:class:`zquant.quantizers.QuantizedWeight`. Each wrapper has a torch reference
in :mod:`zquant.quantizers` it is tested against (``tests/znative/test_quant_kernels.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

import znative
from zquant.quantizers import QuantizedWeight, group_geometry


def _c(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as a contiguous CPU tensor of ``dtype`` (a no-op when it already is one)."""
    return t.detach().to(device="cpu", dtype=dtype).contiguous()


def int8_gemm(a: Tensor, b: Tensor) -> Tensor:
    """``a (m, k) int8 @ b (n, k) int8^T`` as int32 ``(m, n)``, exact."""
    out = torch.empty(a.shape[0], b.shape[0], dtype=torch.int32)
    znative.int8_gemm(_c(a, torch.int8).numpy(), _c(b, torch.int8).numpy(), out.numpy())
    return out


def quantize_tokenwise(x: Tensor, bits: int = 8) -> tuple[Tensor, Tensor]:
    """Native :func:`zquant.quantizers.quantize_activation_tokenwise` for ``x (..., k)``."""
    x2 = _c(x, torch.float32).reshape(-1, x.shape[-1])
    q = torch.empty(x2.shape, dtype=torch.int8)
    scale = torch.empty(x2.shape[0], dtype=torch.float32)
    znative.quantize_tokenwise(x2.numpy(), q.numpy(), scale.numpy(), bits=bits)
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], 1)


def int8_linear(
    x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None, *, outliers: int = 0
) -> Tensor:
    """W8A8 linear in one native call: ``x (m, k) float32``, ``w (n, k) int8``,
    ``w_scale (n,)`` or ``(1,)``; returns float32 ``(m, n)``. With ``outliers`` > 0 the
    ``outliers`` input channels of largest magnitude over the rows stay in float32
    (:class:`zquant.nn.OutlierQuantLinear`'s split, its reference), added in the GEMM's
    epilogue."""
    x2 = _c(x, torch.float32)
    out = torch.empty(x2.shape[0], w.shape[0], dtype=torch.float32)
    b = None if bias is None else _c(bias, torch.float32).numpy()
    znative.int8_linear(
        x2.numpy(),
        _c(w, torch.int8).numpy(),
        _c(w_scale, torch.float32).numpy(),
        b,
        out.numpy(),
        outliers=outliers,
    )
    return out


def int8_linear_split(
    x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None, cols: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """:class:`zquant.nn.OutlierQuantLinear`'s W8A8 split around its outlier term, in one
    native call: ``(y, xo, wc)`` with ``y (m, n)`` the INT8 part of ``x (m, k)`` with the
    channels ``cols`` zeroed (+ bias), ``xo = x[:, cols]`` and ``wc = w[:, cols] * w_scale``
    (the layer's ``_weight_columns``); the layer's output is ``y + xo @ wc.t()``, that sum
    left to torch so that it adds as the torch path's does."""
    x2 = _c(x, torch.float32)
    m, n, t = x2.shape[0], w.shape[0], cols.numel()
    out = torch.empty(m, n, dtype=torch.float32)
    xo = torch.empty(m, t, dtype=torch.float32)
    wc = torch.empty(n, t, dtype=torch.float32)
    b = None if bias is None else _c(bias, torch.float32).numpy()
    znative.int8_linear_split(
        x2.numpy(),
        _c(w, torch.int8).numpy(),
        _c(w_scale, torch.float32).numpy(),
        b,
        _c(cols, torch.int64).numpy(),
        out.numpy(),
        xo.numpy(),
        wc.numpy(),
    )
    return out, xo, wc


def packed_args(qw: QuantizedWeight) -> dict[str, object]:
    """The keyword arguments of ``znative.dequantize_weight`` / ``dequant_linear`` for ``qw``:
    numpy views of its buffers (``data``, ``scale``, ``data2``, ``zero``) and its format
    (``fmt``, ``group_size``, ``offset``). A caller that runs the same weight many times
    (zserve's decode steps) takes them once."""
    spec = qw.spec
    if spec.fmt == "fp6":
        fmt, offset = "fp6", 0
    elif spec.fmt == "int" and 3 <= spec.bits <= 4:
        fmt, offset = "int4", (2 ** (spec.bits - 1) if spec.symmetric else 0)
    else:
        raise ValueError(
            f"native dequantize supports int3/int4 and fp6 weights, got {spec.describe()}; "
            "use zquant.quantizers.dequantize_weight"
        )
    group, _ = group_geometry(spec, qw.shape[1])
    return {
        "data": _c(qw.data, torch.uint8).numpy(),
        "scale": _c(qw.scale, torch.float32).numpy(),
        "fmt": fmt,
        "group_size": group,
        "data2": None if qw.data2 is None else _c(qw.data2, torch.uint8).numpy(),
        "zero": None if qw.zero is None else _c(qw.zero, torch.float32).numpy(),
        "offset": offset,
    }


def supports(qw: QuantizedWeight) -> bool:
    """Whether the native dequantize kernels handle ``qw`` (INT3/INT4 or FP6)."""
    return qw.spec.fmt == "fp6" or (qw.spec.fmt == "int" and 3 <= qw.spec.bits <= 4)


def dequantize(qw: QuantizedWeight) -> Tensor:
    """Native :func:`zquant.quantizers.dequantize_weight` (INT3/INT4 and FP6), float32 ``(out, in)``."""
    args = packed_args(qw)
    out = torch.empty(qw.shape, dtype=torch.float32)
    znative.dequantize_weight(args.pop("data"), args.pop("scale"), out.numpy(), **args)  # type: ignore[arg-type]
    return out


def dequant_linear(x: Tensor, qw: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """``x (m, k) @ dequant(qw)^T + bias`` with weight tiles dequantized in cache; float32 ``(m, n)``."""
    args = packed_args(qw)
    x2 = _c(x, torch.float32)
    out = torch.empty(x2.shape[0], qw.shape[0], dtype=torch.float32)
    b = None if bias is None else _c(bias, torch.float32).numpy()
    znative.dequant_linear(x2.numpy(), args.pop("data"), args.pop("scale"), b, out.numpy(), **args)  # type: ignore[arg-type]
    return out
