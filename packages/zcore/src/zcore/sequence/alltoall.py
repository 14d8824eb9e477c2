"""Ulysses' two all-to-alls over the ``cp`` axis, for any head count and slice length.

Each ``cp`` rank holds a consecutive slice of the sequence with every head; attention needs
the whole sequence for some heads. :func:`seq_to_heads` sends each rank the heads it owns
from every slice; :func:`heads_to_seq` sends the attention output back. Heads are split as
evenly as they go (the first ``heads % cp`` ranks own one more) and slices may differ in
length, so nothing is padded: every transfer is one flat ``all_to_all_single`` whose splits
are in elements. The backward of an all-to-all is the all-to-all with the splits swapped.

Shapes (batch first): a slice is ``(b, L_r, h, d)``; the head-sharded tensor is
``(b, S, h_r, d)`` with ``S = sum(L_r)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zcore.comm import Comm


def even_split(total: int, parts: int) -> list[int]:
    """``total`` cut into ``parts`` consecutive counts differing by at most one (larger first)."""
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def starts(counts: Sequence[int]) -> list[int]:
    """The offset of each count's range (exclusive prefix sums)."""
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


class _AllToAll(torch.autograd.Function):
    """A flat ``all_to_all_single`` whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, comm: Comm, send: list[int], recv: list[int], what: str
    ) -> torch.Tensor:
        ctx.comm, ctx.send, ctx.recv, ctx.what = comm, send, recv, what
        out = x.new_empty(sum(recv))
        comm.all_to_all_single(out, x.contiguous(), recv, send, what).wait()
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        back = grad.new_empty(sum(ctx.send))
        ctx.comm.all_to_all_single(
            back, grad.contiguous(), ctx.send, ctx.recv, f"{ctx.what} backward"
        ).wait()
        return back, None, None, None, None


def all_to_all_flat(
    x: torch.Tensor, comm: Comm, send: list[int], recv: list[int], what: str
) -> torch.Tensor:
    """``x`` (1-D, ``sum(send)`` elements) exchanged: ``send[r]`` elements go to rank ``r``,
    ``recv[r]`` come from it; differentiable."""
    if comm.size == 1:
        return x
    return _AllToAll.apply(x, comm, send, recv, what)


def seq_to_heads(
    xs: Sequence[torch.Tensor],
    comm: Comm,
    lens: Sequence[int],
    head_ranges: Sequence[Sequence[tuple[int, int]]],
    what: str,
) -> list[torch.Tensor]:
    """This rank's slices ``(b, L_me, h_t, d_t)`` -> the heads it owns of each over the whole
    sequence, ``(b, S, h_t_me, d_t)``, in one all-to-all (so every rank issues the same
    collectives in the same order, forward and backward). Rank ``r`` receives heads
    ``head_ranges[t][r]`` of ``xs[t]`` (ranges may overlap: a key/value head two ranks need
    goes to both); ``lens[r]`` is rank ``r``'s slice length."""
    me = comm.rank
    by_head = [x.permute(2, 0, 1, 3) for x in xs]  # (h, b, L, d)
    parts = [
        torch.cat(
            [
                t[ranges[r][0] : ranges[r][1]].reshape(-1)
                for t, ranges in zip(by_head, head_ranges, strict=True)
            ]
        )
        for r in range(comm.size)
    ]
    send = [p.numel() for p in parts]
    mine = [
        (ranges[me][1] - ranges[me][0], x.shape[0], x.shape[3])
        for x, ranges in zip(xs, head_ranges, strict=True)
    ]
    sizes = [[h * b * n * d for h, b, d in mine] for n in lens]
    flat = all_to_all_flat(torch.cat(parts), comm, send, [sum(s) for s in sizes], what)
    per_source = [
        [p.view(h, b, n, d) for p, (h, b, d) in zip(block.split(size), mine, strict=True)]
        for block, size, n in zip(flat.split([sum(s) for s in sizes]), sizes, lens, strict=True)
    ]
    return [
        torch.cat([src[t] for src in per_source], dim=2).permute(1, 2, 0, 3)  # (b, S, h_me, d)
        for t in range(len(xs))
    ]


def heads_to_seq(
    y: torch.Tensor,
    comm: Comm,
    lens: Sequence[int],
    head_counts: Sequence[int],
    what: str,
) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads` for disjoint head ranges: ``(b, S, h_me, d)`` ->
    this rank's slice with every head, ``(b, L_me, h, d)`` (heads in rank order)."""
    b, _, _, d = y.shape
    me = comm.rank
    by_head = y.permute(2, 0, 1, 3)  # (h_me, b, S, d)
    parts = [p.reshape(-1) for p in by_head.split(list(lens), dim=2)]
    send = [p.numel() for p in parts]
    recv = [h * b * lens[me] * d for h in head_counts]
    flat = all_to_all_flat(torch.cat(parts), comm, send, recv, what)
    pieces = [p.view(h, b, lens[me], d) for p, h in zip(flat.split(recv), head_counts, strict=True)]
    return torch.cat(pieces, dim=0).permute(1, 2, 0, 3)  # (b, L_me, h, d)
