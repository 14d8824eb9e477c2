"""qwZ: stage-3 parameter all-gathers as block-quantized INT8.

Before a module runs, ZeRO-3 all-gathers its parameters' shards. qwZ quantizes each rank's
shard (symmetric INT8, one fp32 scale per block of :data:`QWZ_BLOCK` elements,
:mod:`zcomm.blockquant`), all-gathers the codes and scales as one byte buffer
(:mod:`.wire`), and dequantizes every rank's piece, this rank's own included, into the
full-precision output. So every rank computes with the same weights, which differ from
the master weights by at most ``max|block| / 254`` per element; the optimizer keeps
stepping the exact master weights, so the error does not accumulate.

Bytes per element on the wire: 1 + 4 / QWZ_BLOCK instead of the model dtype's 2 or 4.
DeepSpeed picks about 4-8k elements per group so that groups divide the tensor; the wire
format here has no divisibility needs (the last block is short), so the block is fixed.
"""

from __future__ import annotations

import torch

from zcomm.zeropp.wire import Then, pack_into, packet_bytes, unpack
from zcore.comm import Comm, Handle

QWZ_BITS = 8
QWZ_BLOCK = 2048
"""Elements per quantization block of a weight gather."""


def quantized_all_gather(
    comm: Comm, out: torch.Tensor, inp: torch.Tensor, what: str, block: int = QWZ_BLOCK
) -> Handle:
    """Every rank's ``inp`` into ``out`` (rank order, ``out``'s dtype), sent as INT8.

    Row ``r`` of ``out.view(comm.size, -1)`` is rank ``r``'s ``inp`` after a quantize /
    dequantize round trip; the work after the transfer runs in the handle's ``wait``.
    """
    w = comm.size
    n = inp.numel()
    size = packet_bytes(n, QWZ_BITS, block)
    send = torch.empty(size, dtype=torch.uint8, device=inp.device)
    pack_into(send, inp, QWZ_BITS, block)
    recv = torch.empty(w * size, dtype=torch.uint8, device=inp.device)
    inner = comm.all_gather(recv, send, f"{what} as int8")

    def finish() -> None:
        rows = recv.view(w, size)
        grid = out.view(w, n)
        for r in range(w):
            grid[r].copy_(unpack(rows[r], QWZ_BITS, block, n))

    return Then(comm, inner, finish)
