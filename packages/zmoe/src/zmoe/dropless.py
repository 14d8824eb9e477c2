"""The dropless path's dispatch: routes sorted by expert, each expert a contiguous slice.

No capacity, no padding: the ``R`` kept routes (``T*k`` unless ``used_token`` masked some)
are ordered by expert with one stable ``argsort``, the token rows gathered in that order,
each expert runs on its own slice, and the results are weighted by their gate and summed
back into their tokens with ``index_add_`` (in fp32).

Under expert parallelism the sorted rows are already grouped by destination rank (experts
are laid out rank after rank), so one uneven all-to-all sends them. A rank receives them
grouped by source rank, then expert; :func:`by_expert` reorders them expert-major so each
local expert again sees one contiguous slice, and :func:`by_source` undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Plan:
    """Where each of the ``R`` kept routes goes, in expert order."""

    tokens: Tensor
    """[R] int64 token of each sorted route."""
    weights: Tensor
    """[R] fp32 gate of each sorted route."""
    counts: Tensor
    """[E] int64 routes per global expert."""
    order: Tensor | None
    """[T*k] the sort permutation when every route is kept (None when some were not routed)."""


def plan(indices: Tensor, gates: Tensor, num_experts: int) -> Plan:
    """Sort the [T, k] routes by expert; routes with expert -1 (not routed) are left out."""
    k = indices.shape[1]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    skipped = flat.numel() - int(counts.sum())
    kept = order[skipped:]  # the -1 routes sort first
    return Plan(kept // k, gates.reshape(-1)[kept], counts, None if skipped else order)


def gather(x: Tensor, p: Plan) -> Tensor:
    """[R, d] token rows in expert order."""
    return x.index_select(0, p.tokens)


def combine(y: Tensor, p: Plan, tokens: int) -> Tensor:
    """[T, d]: each sorted result times its gate, summed into its token (fp32, then cast).

    With every route kept, the rows are put back in (token, route) order with one
    ``index_select`` and summed over the k routes (measured 3-5x faster on CPU than the
    ``index_add_`` scatter, which remains for masked tokens).
    """
    if p.order is not None and tokens:
        k = p.order.numel() // tokens
        routed = y.index_select(0, torch.argsort(p.order)).view(tokens, k, -1)
        weights = p.weights.index_select(0, torch.argsort(p.order)).view(tokens, k, 1)
        return (routed * weights).sum(dim=1).to(y.dtype)
    out = torch.zeros(tokens, y.shape[1], dtype=torch.float32, device=y.device)
    out.index_add_(0, p.tokens, y.float() * p.weights.unsqueeze(1))
    return out.to(y.dtype)


def expert_major(recv_counts: Tensor) -> Tensor:
    """The permutation taking rows grouped (source rank, local expert) to (local expert,
    source rank); ``recv_counts`` [ep, E_local] rows received per source and expert."""
    ep, local = recv_counts.shape
    segment = torch.repeat_interleave(
        torch.arange(ep * local, device=recv_counts.device), recv_counts.reshape(-1)
    )
    key = (segment % local) * ep + segment // local
    return torch.argsort(key, stable=True)


def by_expert(x: Tensor, perm: Tensor) -> Tensor:
    return x.index_select(0, perm)


def by_source(y: Tensor, perm: Tensor) -> Tensor:
    """Undo :func:`by_expert` (an ``index_select`` with the inverse permutation)."""
    return y.index_select(0, torch.argsort(perm))
