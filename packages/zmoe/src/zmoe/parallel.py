"""Tokens across the expert-parallel ranks: an all-to-all that autograd can run backwards.

Every exchange goes through :meth:`zcore.comm.collectives.Comm.all_to_all_single`, so it
keeps the job's timeout and its rank/op/step message. The backward of sending block ``r``
to rank ``r`` is the same all-to-all with the splits swapped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zcore.comm.collectives import Comm


class AllToAll(torch.autograd.Function):
    """``out`` block ``r`` = rank ``r``'s ``inp`` block for this rank (rows; None: even)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        inp: Tensor,
        comm: Comm,
        out_splits: list[int] | None,
        in_splits: list[int] | None,
        what: str,
    ) -> Tensor:
        ctx.comm, ctx.out_splits, ctx.in_splits, ctx.what = comm, out_splits, in_splits, what
        rows = inp.shape[0] if out_splits is None else sum(out_splits)
        out = inp.new_empty((rows, *inp.shape[1:]))
        comm.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, what).wait()
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        back = AllToAll.apply(
            grad.contiguous(), ctx.comm, ctx.in_splits, ctx.out_splits, f"{ctx.what} backward"
        )
        return back, None, None, None, None


def all_to_all(
    x: Tensor,
    comm: Comm,
    what: str,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
) -> Tensor:
    """Differentiable all-to-all of the rows of ``x`` over ``comm``."""
    return AllToAll.apply(x, comm, out_splits, in_splits, what)


def exchange_counts(counts: Tensor, comm: Comm, what: str) -> Tensor:
    """[ep, E_local]: rows each source rank will send to each of this rank's experts, from
    every rank's ``counts`` [E] (routes per global expert, experts laid out rank by rank)."""
    recv = torch.empty_like(counts)
    comm.all_to_all_single(recv, counts.contiguous(), None, None, what).wait()
    return recv.view(comm.size, -1)
