"""Compressed reduce-scatter with error feedback: phase 1 of the 1-bit all-reduce alone.

ZeRO stages 1-2 cut the optimizer state across ranks: rank ``r`` needs only slot ``r`` of
the averaged gradient, never the whole of it. So where :class:`~zcomm.compressed.
CompressedAllReduce` averages then compresses the average again and all-gathers it, this
stops after the first phase: each rank compresses its whole local gradient grid
``(world, P)`` (row ``r`` = its values for rank ``r``'s slot) to signs and one scale,
keeps what compression dropped (worker error feedback), and sends row ``r`` to rank ``r``
with one ``all_to_all``; rank ``r`` averages the ``world`` decompressed rows it receives.
The owner keeps its average exact (no server compression: nobody else needs it).

Per rank and call it sends ``world * (P8 / 8 + 4)`` bytes (``P8``: ``P`` rounded up to a
multiple of 8), about 1/32 of the ``4 * world * P`` an fp32 reduce-scatter hands over.
:func:`reference_compressed_reduce_scatter` is the readable single-process model.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from zcomm.compressed import ErrorFeedbackReset, _bytes_as_scales, _scale_as_bytes
from zcomm.kernels import pack_signs, unpack_signs
from zcomm.signs import sign_scale, signs
from zcore.comm import Comm


def _padded_cols(cols: int) -> int:
    return -(-cols // 8) * 8


class CompressedReduceScatter:
    """Averages ``(world, P)`` grids across ``comm``'s ranks, rank ``r`` keeping row ``r``,
    1-bit compressed with worker error feedback (one error buffer per ``key``)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.errors: dict[str, torch.Tensor] = {}
        self.bytes_sent = 0
        self.last_bytes = 0

    def __call__(self, grid_WP: torch.Tensor, key: str) -> torch.Tensor:
        """This rank's row of the average of every rank's ``grid_WP`` (fp32, ``(P,)``)."""
        world = self.comm.size
        if grid_WP.dim() != 2 or grid_WP.shape[0] != world:
            raise ValueError(
                f"compressed reduce-scatter `{key}`: expected a ({world}, P) "
                f"grid, got {tuple(grid_WP.shape)}"
            )
        cols = grid_WP.shape[1]
        cols8 = _padded_cols(cols)
        x_WC = torch.zeros(world, cols8, dtype=torch.float32, device=grid_WP.device)
        x_WC[:, :cols] = grid_WP
        err = self.errors.get(key)
        if err is not None:
            if err.shape != x_WC.shape:
                raise ValueError(
                    f"compressed reduce-scatter `{key}`: grid {tuple(x_WC.shape)} "
                    f"but its error buffer is {tuple(err.shape)}; one key per grid"
                )
            x_WC.add_(err.to(x_WC.device))
        scale = sign_scale(x_WC)
        self.errors[key] = x_WC - scale * signs(x_WC)
        row_bytes = cols8 // 8
        send_WB = torch.empty(world, row_bytes + 4, dtype=torch.uint8, device=x_WC.device)
        send_WB[:, :row_bytes] = pack_signs(x_WC).view(world, row_bytes)
        send_WB[:, row_bytes:] = _scale_as_bytes(scale)
        recv_WB = torch.empty_like(send_WB)
        self.comm.all_to_all_single(
            recv_WB, send_WB, None, None, f"compressed reduce-scatter `{key}`"
        ).wait()
        signs_WC = unpack_signs(recv_WB[:, :row_bytes].reshape(-1), world * cols8).view(
            world, cols8
        )
        out_C = signs_WC.mul_(_bytes_as_scales(recv_WB[:, row_bytes:]).mul(1 / world)).sum(0)
        self.last_bytes = send_WB.numel()
        self.bytes_sent += self.last_bytes
        return out_C[:cols]

    def reset(self) -> None:
        self.errors.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"world": self.comm.size, "errors": {k: e.clone() for k, e in self.errors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.errors.clear()
        if state["world"] != self.comm.size:
            warnings.warn(
                f"compressed reduce-scatter error buffers were saved at world {state['world']} "
                f"and this job has world {self.comm.size}; they start from zero",
                ErrorFeedbackReset,
                stacklevel=2,
            )
            return
        self.errors = {k: e.to(torch.float32).clone() for k, e in state["errors"].items()}


def reference_compressed_reduce_scatter(
    grids: list[torch.Tensor], errors: list[torch.Tensor] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each rank's averaged row and new worker error, every rank simulated in turn, with
    dense ``+1``/``-1`` signs (0 counts as +1) and the same fp32 operations in the same
    order, so :class:`CompressedReduceScatter` must match it exactly."""
    world, cols = grids[0].shape
    cols8 = _padded_cols(cols)
    new_errors, rows = [], []
    for rank in range(world):
        x = torch.zeros(world, cols8)
        x[:, :cols] = grids[rank].float()
        if errors is not None:
            x = x + errors[rank]
        scale = torch.linalg.norm(x.reshape(-1)) / math.sqrt(x.numel())
        sign = torch.where(x < 0, -1.0, 1.0)
        new_errors.append(x - scale * sign)
        rows.append(sign * (scale * (1 / world)))
    outs = [torch.stack([rows[i][r] for i in range(world)]).sum(0)[:cols] for r in range(world)]
    return outs, new_errors
