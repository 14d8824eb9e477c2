"""The autograd functions at the edges of a tensor-parallel region (Megatron's mappings).

A tensor-parallel region is the part of a layer where each ``tp`` rank holds a different
slice of the activations. Four functions cross its edges, each a collective in one
direction and its adjoint in the other:

============  ==============================  ==============================
function      forward                         backward
============  ==============================  ==============================
copy_to       identity                        all-reduce (sum) the gradient
reduce_from   all-reduce (sum)                identity
gather_from   all-gather the last dimension   keep this rank's slice
scatter_to    keep this rank's slice          all-gather the last dimension
============  ==============================  ==============================

Under sequence parallelism (Megatron's), the activations between the cut layers (norms,
dropout, residuals) hold ``T/tp`` positions of each sequence instead of all of them:
``gather_seq`` (all-gather the positions forward, reduce-scatter the gradient backward)
replaces ``copy_to`` at a column cut's input and ``reduce_scatter_seq`` (its adjoint)
replaces ``reduce_from`` at a row cut's output.

Every collective goes through the mesh's ``tp`` :class:`~zcore.comm.Comm`, so it is bounded
by the job's timeout, labelled with its op and training step in errors, and counted in the
mesh's byte accounting. On a one-rank ``tp`` axis they are all identities.
"""

from __future__ import annotations

from typing import Any

import torch

from zcore.comm import Comm


def _all_reduce(x: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, what).wait()
    return out


def _gather_last(x: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
    """(..., n) on each rank -> (..., size * n), rank order."""
    x = x.contiguous()
    out = x.new_empty((comm.size * x.shape[0], *x.shape[1:]))  # gloo: concatenated on dim 0
    comm.all_gather(out, x, what).wait()
    return torch.cat(out.chunk(comm.size, dim=0), dim=-1)


def _slice_last(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    n = x.shape[-1] // comm.size
    return x[..., comm.rank * n : (comm.rank + 1) * n].contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
        ctx.comm, ctx.what = comm, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _all_reduce(grad, ctx.comm, f"all_reduce(tp grad of {ctx.what})"), None, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
        return _all_reduce(x, comm, f"all_reduce(tp {what})")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
        ctx.comm = comm
        return _gather_last(x, comm, f"all_gather(tp {what})")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _slice_last(grad, ctx.comm), None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
        ctx.comm, ctx.what = comm, what
        return _slice_last(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _gather_last(grad, ctx.comm, f"all_gather(tp grad of {ctx.what})"), None, None


def copy_to(x: torch.Tensor, comm: Comm, what: str = "input") -> torch.Tensor:
    """``x`` unchanged; its gradient summed over ``tp`` (the input of a column cut)."""
    return x if comm.size == 1 else _CopyTo.apply(x, comm, what)


def reduce_from(x: torch.Tensor, comm: Comm, what: str = "output") -> torch.Tensor:
    """``x`` summed over ``tp`` (the partial output of a row cut)."""
    return x if comm.size == 1 else _ReduceFrom.apply(x, comm, what)


def gather_from(x: torch.Tensor, comm: Comm, what: str = "output") -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dimension in ``tp`` order."""
    return x if comm.size == 1 else _GatherFrom.apply(x, comm, what)


def scatter_to(x: torch.Tensor, comm: Comm, what: str = "input") -> torch.Tensor:
    """This rank's slice of the last dimension of ``x`` (equal slices in ``tp`` order)."""
    return x if comm.size == 1 else _ScatterTo.apply(x, comm, what)


# -- sequence parallelism: activations outside the cut layers hold T/tp positions ---------


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).contiguous()  # (B, T, ...) -> (T, B, ...): collectives cut dim 0


def _gather_seq(x: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
    """(B, T/tp, ...) on each rank -> (B, T, ...), positions in ``tp`` order."""
    local = _seq_first(x)
    out = local.new_empty((comm.size * local.shape[0], *local.shape[1:]))
    comm.all_gather(out, local, what).wait()
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> this rank's (B, T/tp, ...) of their sum."""
    full = _seq_first(x)
    out = full.new_empty((full.shape[0] // comm.size, *full.shape[1:]))
    comm.reduce_scatter(out, full, what).wait()
    return out.transpose(0, 1)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
        ctx.comm, ctx.what = comm, what
        return _gather_seq(x, comm, f"all_gather(tp sequence of {what})")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        what = f"reduce_scatter(tp grad of {ctx.what})"
        return _reduce_scatter_seq(grad, ctx.comm, what), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
        ctx.comm, ctx.what = comm, what
        return _reduce_scatter_seq(x, comm, f"reduce_scatter(tp {what})")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        what = f"all_gather(tp sequence grad of {ctx.what})"
        return _gather_seq(grad.contiguous(), ctx.comm, what), None, None


def gather_seq(x: torch.Tensor, comm: Comm, what: str = "input") -> torch.Tensor:
    """Every rank's positions of ``x`` (B, T/tp, ...) as (B, T, ...); the gradient is
    reduce-scattered back (the input of a column cut under sequence parallelism)."""
    return x if comm.size == 1 else _GatherSeq.apply(x, comm, what)


def reduce_scatter_seq(x: torch.Tensor, comm: Comm, what: str = "output") -> torch.Tensor:
    """This rank's positions (B, T/tp, ...) of ``x`` summed over ``tp``; the gradient is
    all-gathered (the output of a row cut under sequence parallelism)."""
    return x if comm.size == 1 else _ReduceScatterSeq.apply(x, comm, what)
