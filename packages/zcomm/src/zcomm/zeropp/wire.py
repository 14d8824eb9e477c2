"""What ZeRO++ puts on the wire: block-quantized tensors as one byte buffer each.

A tensor of ``n`` elements quantized to ``bits`` in blocks of ``block``
(:mod:`zcomm.blockquant`) travels as its codes followed by its fp32 scales' bytes, so one
collective carries both (DeepSpeed sends codes and scales as two collectives)::

    [ code_bytes(n, bits) bytes of codes | 4 * ceil(n / block) bytes of scales ]

Every rank can compute the packet size from ``n`` alone, which collectives with fixed
split sizes need. :class:`Then` is the handle of a collective whose result still needs
work (dequantization, a second stage) once it arrives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zcomm.blockquant import code_bytes, num_blocks
from zcomm.kernels import dequantize_blocks, quantize_blocks
from zcore.comm import Comm, Handle


def packet_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes of one packed tensor of ``numel`` elements."""
    return code_bytes(numel, bits) + 4 * num_blocks(numel, block)


def pack_into(out: torch.Tensor, x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Quantize ``x`` (read flat) into the uint8 buffer ``out`` (:func:`packet_bytes` long);
    returns ``x`` as the receiver will read it back (float32), for error feedback."""
    codes, scales = quantize_blocks(x, bits, block)
    nc = codes.numel()
    out[:nc].copy_(codes)
    out[nc:].copy_(scales.view(torch.uint8))
    return dequantize_blocks(codes, scales, bits, block, x.numel())


def unpack(buf: torch.Tensor, bits: int, block: int, numel: int) -> torch.Tensor:
    """The float32 values of one packet (``buf``: :func:`packet_bytes` uint8)."""
    nc = code_bytes(numel, bits)
    scales = buf[nc:].clone().view(torch.float32)  # clone: a view at any byte offset
    return dequantize_blocks(buf[:nc], scales, bits, block, numel)


class Then(Handle):
    """A collective's handle that runs ``finish`` once, after the collective, on ``wait``."""

    def __init__(self, comm: Comm, inner: Handle, finish: Callable[[], None]) -> None:
        super().__init__(comm, None, inner.what, inner.step)
        self._inner: Handle | None = inner
        self._finish = finish

    def wait(self) -> None:
        if self._inner is None:
            return
        inner, self._inner = self._inner, None
        inner.wait()
        self._finish()
