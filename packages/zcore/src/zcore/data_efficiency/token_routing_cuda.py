"""The CUDA twins of random-LTD's gather/scatter (``znative/cuda/kernels/random_ltd.cu``),
launched on torch's current stream; :mod:`zcore.data_efficiency.token_routing` picks them
for CUDA tensors when CuPy is present and is their reference. CuPy is imported on first
use, never by importing this module."""

from __future__ import annotations

from functools import cache

import torch

import znative.cuda

_THREADS = 128
_WORD = {4: (torch.int32, "w32"), 2: (torch.int16, "w16")}


@cache
def available() -> bool:
    """CuPy imports and a CUDA device is visible (checked once per process)."""
    ok, _ = znative.cuda.cupy_status()
    return ok and torch.cuda.is_available()


def _launch(
    kernel: str, dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, seq_len: int
) -> None:
    """``kernel`` over the (B*K) kept rows; dst/src viewed as words of their element size."""
    word, suffix = _WORD[dst.element_size()]
    B, K = idx.shape
    if B * K == 0:
        return
    words = dst.shape[-1]
    i64 = znative.cuda.i64
    znative.cuda.launch(
        "random_ltd",
        f"{kernel}_{suffix}",
        B * K,
        _THREADS,
        (dst.view(word), src.view(word), idx.contiguous(), i64(seq_len), i64(K), i64(words)),
        stream=torch.cuda.current_stream(dst.device).cuda_stream,
        device=dst.device.index,
    )


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(B, T, C) contiguous, (B, K) int64 -> (B, K, C): x at idx."""
    B, T, C = x.shape
    part = x.new_empty(B, idx.shape[1], C)
    _launch("random_ltd_gather", part, x, idx, T)
    return part


def scatter_(out: torch.Tensor, part: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Write part (B, K, C) into out (B, T, C) at idx, in place; returns out."""
    _launch("random_ltd_scatter", out, part.to(out.dtype).contiguous(), idx, out.shape[1])
    return out
