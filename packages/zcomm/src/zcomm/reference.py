"""A readable, single-process model of the compressed all-reduce: every rank simulated in turn.

Written from the description of 1-bit Adam's error-compensated compressed all-reduce
(Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", 2021, and DeepSpeed's ``compressed_allreduce``), with dense ``+1`` /
``-1`` signs and no bit packing or collectives, so the tests can hold
:class:`zcomm.compressed.CompressedAllReduce` to it exactly. It repeats the arithmetic in the
same order (the same fp32 operations give the same bits), not the code.
"""

from __future__ import annotations

import math

import torch


def _sign(x: torch.Tensor) -> torch.Tensor:
    """+1 where x is not negative (0 counts as +1), -1 where it is."""
    return torch.where(x < 0, -1.0, 1.0).to(torch.float32)


def _scale(x: torch.Tensor) -> torch.Tensor:
    """The 1-bit scale: ||x|| / sqrt(len(x)), so scale * sign(x) has x's L2 norm."""
    return torch.linalg.norm(x) / math.sqrt(x.numel())


def reference_compressed_allreduce(
    inputs: list[torch.Tensor],
    worker_errors: list[torch.Tensor] | None = None,
    server_errors: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Each rank's output and new worker and server errors, for ``inputs[rank]`` on each rank.

    ``worker_errors[rank]`` has the padded size ``N`` (a multiple of ``world * lcm(world, 8)``),
    ``server_errors[rank]`` ``N / world``; None: zeros (the first call).
    """
    world = len(inputs)
    n = inputs[0].numel()
    multiple = world * math.lcm(world, 8)
    padded = -(-n // multiple) * multiple
    chunk = padded // world
    if worker_errors is None:
        worker_errors = [torch.zeros(padded) for _ in range(world)]
    if server_errors is None:
        server_errors = [torch.zeros(chunk) for _ in range(world)]

    # 1. Each worker adds its error to its (zero-padded) input and compresses the whole buffer.
    worker_signs, worker_scales, new_worker_errors = [], [], []
    for rank in range(world):
        x = torch.zeros(padded)
        x[:n] = inputs[rank].reshape(-1).float()
        x = x + worker_errors[rank]
        scale, sign = _scale(x), _sign(x)
        worker_signs.append(sign)
        worker_scales.append(scale)
        new_worker_errors.append(x - scale * sign)

    # 2. Rank r is the server of chunk r: it averages every worker's decompressed chunk r,
    #    adds its own error and compresses the average.
    server_signs, server_scales, new_server_errors = [], [], []
    for r in range(world):
        part = slice(r * chunk, (r + 1) * chunk)
        decompressed = [
            worker_signs[i][part] * (worker_scales[i] * (1 / world)) for i in range(world)
        ]
        m = torch.stack(decompressed).sum(0) + server_errors[r]
        scale, sign = _scale(m), _sign(m)
        server_signs.append(sign)
        server_scales.append(scale)
        new_server_errors.append(m - scale * sign)

    # 3. Every rank receives every server's compressed chunk: the same result everywhere.
    result = torch.cat([server_signs[r] * server_scales[r] for r in range(world)])[:n]
    outputs = [
        result.view(inputs[rank].shape).to(inputs[rank].dtype, copy=True) for rank in range(world)
    ]
    return outputs, new_worker_errors, new_server_errors
