"""The blocks ring attention computes: one query run against one key run, with its
log-sum-exp, forward and backward.

:func:`tiles` cuts what one key/value block contributes to this rank's queries into tiles:
one query run against one key run, either fully visible or the causal diagonal (the same
positions on both sides, so the mask is square and top-left aligned) or skipped (wholly in
the queries' future). Every query row of a tile sees at least one key, so each tile's
log-sum-exp is finite.

Two backends compute a tile on ``(b, h, L, d)`` float tensors (as many key/value heads as
query heads): :data:`FLASH`, torch's flash-attention kernel for CPU (``O(L)`` memory: the
scores are never materialized; its backward takes the final output and log-sum-exp of the
whole ring, which makes each tile's gradient exactly its share), and :data:`REFERENCE`, the
same arithmetic written out (materializes a tile's scores; any device). The backward of a
tile, given the merged output ``O`` and log-sum-exp ``lse`` of the whole row: ``P = exp(S -
lse)``, ``dV = P^T dO``, ``dS = P (dO V^T - rowsum(dO O))``, ``dQ = dS K s``, ``dK = dS^T Q s``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zcore.sequence.alltoall import starts

Runs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Tile:
    """Local query rows ``[qa, qb)`` against local key columns ``[ka, kb)``; ``diag``: the
    causal diagonal (the same global positions, masked above the diagonal)."""

    qa: int
    qb: int
    ka: int
    kb: int
    diag: bool


def tiles(q_runs: Runs, k_runs: Runs, causal: bool) -> list[Tile]:
    """The tiles one block (held as ``k_runs``) adds to queries held as ``q_runs``."""
    out = []
    for (a, b), qa in zip(q_runs, starts([b - a for a, b in q_runs]), strict=True):
        for (c, e), ka in zip(k_runs, starts([e - c for c, e in k_runs]), strict=True):
            if causal and b - 1 < c:
                continue  # every key after every query
            diag = causal and a < e - 1
            if diag and (a, b) != (c, e):
                raise ValueError(
                    f"query positions [{a}, {b}) and key positions [{c}, {e}) overlap in part: "
                    "a ring layout's runs must be pieces of one partition of the sequence "
                    "(RingLayout.consecutive or RingLayout.zigzag)"
                )
            out.append(Tile(qa, qa + b - a, ka, ka + e - c, diag))
    return out


@dataclass(frozen=True)
class Backend:
    """How a tile is computed: ``forward(q, k, v, diag, scale) -> (out, lse)`` and
    ``backward(dout, q, k, v, out, lse, diag, scale) -> (dq, dk, dv)``."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _scores(q: torch.Tensor, k: torch.Tensor, diag: bool, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale  # (b, h, Lq, Lk)
    if diag:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _reference_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, diag: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, diag, scale)
    return torch.softmax(s, dim=-1) @ v, s.logsumexp(-1)


def _reference_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    diag: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.exp(_scores(q, k, diag, scale) - lse[..., None])  # (b, h, Lq, Lk)
    delta = (dout * out).sum(-1, keepdim=True)  # (b, h, Lq, 1)
    ds = p * (dout @ v.transpose(-1, -2) - delta) * scale
    return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ dout


def _flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, diag: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, diag, attn_mask=None, scale=scale
    )
    return out, lse


def _flash_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    diag: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, diag, attn_mask=None, scale=scale
    )
    return dq, dk, dv


REFERENCE = Backend("reference", _reference_forward, _reference_backward)
FLASH = Backend("flash_cpu", _flash_forward, _flash_backward)


def backend_for(device: torch.device, reference: bool = False) -> Backend:
    """The tile backend for tensors on ``device``: torch's CPU flash kernel where it exists
    (and ``reference`` is not asked for), else the written-out arithmetic."""
    fast = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
    return FLASH if device.type == "cpu" and fast and not reference else REFERENCE
