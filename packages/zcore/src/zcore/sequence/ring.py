"""Ring attention over the ``cp`` axis: each rank keeps its queries, key/value blocks travel.

Every ``cp`` rank holds some positions of each sequence (a :class:`RingLayout`: consecutive
slices, or the load-balanced zig-zag order). Attention runs in ``cp`` steps: at step ``t``
rank ``r`` attends its queries to the key/value block of rank ``r - t`` while that block
already travels on to rank ``r + 1``; the partial results are merged with the online softmax
(each block's output weighted by ``exp(lse_block - lse)``), so no rank ever holds more than
two key/value blocks and one block of scores. Unlike Ulysses, nothing is split over heads:
any head count runs at any ``cp`` (``cp`` above the head count included), and with
grouped-query attention only the key/value heads travel.

Causal masks follow the global positions: a query run and a key run are attended in full,
with the diagonal mask, or skipped, so a rank skips every block wholly in its future. With
consecutive slices the last rank does ``cp`` times the first one's work; the zig-zag layout
(rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``, Megatron's CP order) gives
every rank the same work (the diagonal step aside, equal at every step).

The backward is written by hand and passes the blocks around the ring again, each with the
key/value gradient accumulated so far, so it keeps only this rank's ``q, k, v``, output and
log-sum-exp (``O(L)`` per rank) instead of every block's probabilities (``O(L x S)``, what
autograd through the blocks would save). Arithmetic is in float32; results are cast back.

Transport: each hop is an ``all_to_all_single`` through the ``cp`` :class:`~zcore.comm.Comm`
with one non-empty split (the next rank), so it is bounded, named with its step and counted
by destination like every other collective; the next hop is in flight while a block computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zcore.comm import Comm
from zcore.sequence.alltoall import even_split, starts

Runs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RingLayout:
    """Which global positions each ``cp`` rank holds: per rank, ``(start, end)`` runs in the
    order the rank's local tensor stores them."""

    runs: tuple[Runs, ...]

    @classmethod
    def consecutive(cls, lens: Sequence[int]) -> RingLayout:
        """Rank ``r`` holds ``lens[r]`` positions after those of ranks ``0..r-1``."""
        return cls(tuple(((a, a + n),) for a, n in zip(starts(lens), lens, strict=True)))

    @classmethod
    def zigzag(cls, total: int, cp: int) -> RingLayout:
        """The causal load balance: ``total`` cut into ``2 cp`` chunks (:func:`even_split`);
        rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``."""
        sizes = even_split(total, 2 * cp)
        chunks = [(a, a + n) for a, n in zip(starts(sizes), sizes, strict=True)]
        return cls(
            tuple(
                tuple(c for c in (chunks[r], chunks[2 * cp - 1 - r]) if c[1] > c[0])
                for r in range(cp)
            )
        )

    @property
    def lens(self) -> list[int]:
        """Positions held by each rank."""
        return [sum(b - a for a, b in runs) for runs in self.runs]

    def index(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global positions rank ``rank`` holds, in its local order (``(lens[rank],)``)."""
        parts = [torch.arange(a, b, device=device) for a, b in self.runs[rank]]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


@dataclass
class _Pair:
    """Queries ``[qa, qb)`` of this rank against key columns ``cols`` of one block (local
    offsets); ``mask`` ``(qb - qa, n_cols)`` where only part of them is visible."""

    qa: int
    qb: int
    cols: list[tuple[int, int]]
    mask: torch.Tensor | None


def _pairs(q_runs: Runs, k_runs: Runs, causal: bool, device: torch.device) -> list[_Pair]:
    """What one block contributes to each query run: fully visible key runs, diagonal ones
    (masked) and none of those wholly in the query run's future (skipped)."""
    out = []
    for (a, b), qa in zip(q_runs, starts([b - a for a, b in q_runs]), strict=True):
        cols, partial = [], False
        for (c, e), ka in zip(k_runs, starts([e - c for c, e in k_runs]), strict=True):
            if causal and b - 1 < c:
                continue  # every key after every query
            partial = partial or (causal and a < e - 1)
            cols.append((ka, ka + e - c, c))
        if not cols:
            continue
        mask = None
        if partial:
            qpos = torch.arange(a, b, device=device)
            kpos = torch.cat([torch.arange(c, c + kb - ka, device=device) for ka, kb, c in cols])
            mask = qpos[:, None] >= kpos[None, :]
        out.append(_Pair(qa, qa + b - a, [(ka, kb) for ka, kb, _ in cols], mask))
    return out


def _columns(t: torch.Tensor, cols: list[tuple[int, int]]) -> torch.Tensor:
    """``t`` ``(..., L, d)`` restricted to the positions ``cols``."""
    if len(cols) == 1:
        return t[..., cols[0][0] : cols[0][1], :]
    return torch.cat([t[..., a:b, :] for a, b in cols], dim=-2)


def _scores(q: torch.Tensor, k: torch.Tensor, pair: _Pair, scale: float) -> torch.Tensor:
    """``(b, hkv, g, Lq, Lk)`` scaled scores, masked positions ``-inf``."""
    s = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if pair.mask is None else s.masked_fill(~pair.mask, float("-inf"))


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with ``-inf`` (rows that saw no key yet) as 0, for safe subtraction."""
    return torch.where(torch.isneginf(x), torch.zeros_like(x), x)


def _forward_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pairs: list[_Pair],
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Merge one block into the running ``out`` ``(b, hkv, g, Lq, d)`` and ``lse``."""
    for p in pairs:
        s = _scores(q[..., p.qa : p.qb, :], _columns(k, p.cols), p, scale)
        blk = s.logsumexp(-1)  # (b, hkv, g, Lq_run)
        o = torch.exp(s - _finite(blk)[..., None]) @ _columns(v, p.cols).unsqueeze(2)
        old = lse[..., p.qa : p.qb]
        new = torch.logaddexp(old, blk)
        keep, take = torch.exp(old - _finite(new)), torch.exp(blk - _finite(new))
        rows = out[..., p.qa : p.qb, :]
        rows.copy_(rows * keep[..., None] + o * take[..., None])
        old.copy_(new)


def _backward_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pairs: list[_Pair],
    scale: float,
    lse: torch.Tensor,
    dout: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Add one block's share to ``dq`` and to this block's ``dk``, ``dv`` (``(b, hkv, Lk, d)``)."""
    for p in pairs:
        rows = slice(p.qa, p.qb)
        kc, vc = _columns(k, p.cols), _columns(v, p.cols)
        s = _scores(q[..., rows, :], kc, p, scale)
        prob = torch.exp(s - lse[..., rows, None])  # (b, hkv, g, Lq_run, Lk)
        do = dout[..., rows, :]
        dvc = (prob.transpose(-1, -2) @ do).sum(2)
        ds = prob * (do @ vc.unsqueeze(2).transpose(-1, -2) - delta[..., rows, None]) * scale
        dq[..., rows, :] += ds @ kc.unsqueeze(2)
        dkc = (ds.transpose(-1, -2) @ q[..., rows, :]).sum(2)
        at = 0
        for a, b in p.cols:
            dk[..., a:b, :] += dkc[..., at : at + b - a, :]
            dv[..., a:b, :] += dvc[..., at : at + b - a, :]
            at += b - a


def _hop(comm: Comm, flat: torch.Tensor, incoming: int, what: str) -> tuple[torch.Tensor, Any]:
    """Send ``flat`` to the next rank of the ring and receive ``incoming`` elements from the
    previous one (asynchronous: wait on the returned handle)."""
    n, r = comm.size, comm.rank
    send, recv = [0] * n, [0] * n
    send[(r + 1) % n] = flat.numel()
    recv[(r - 1) % n] = incoming
    out = flat.new_empty(incoming)
    return out, comm.all_to_all_single(out, flat, recv, send, what)


class _Ring(torch.autograd.Function):
    """Ring attention on ``q`` ``(b, hkv, g, Lq, d)``, ``k``/``v`` ``(b, hkv, Lk, d)`` (float32,
    contiguous); returns the output ``(b, hkv, g, Lq, d)``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        comm: Comm,
        layout: RingLayout,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        cp, me = comm.size, comm.rank
        b, hkv, _, d = k.shape
        per_pos = 2 * b * hkv * d  # elements of k and v per position
        out = torch.zeros_like(q)
        lse = q.new_full(q.shape[:-1], float("-inf"))
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        for t in range(cp):
            src = (me - t) % cp
            if t < cp - 1:
                incoming = layout.lens[(src - 1) % cp] * per_pos
                nxt, handle = _hop(comm, kv, incoming, f"ring kv {t + 1}/{cp - 1}")
            kb, vb = (x.view(b, hkv, -1, d) for x in kv.chunk(2))
            pairs = _pairs(layout.runs[me], layout.runs[src], causal, q.device)
            _forward_block(q, kb, vb, pairs, scale, out, lse)
            if t < cp - 1:
                handle.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.layout, ctx.causal, ctx.scale = comm, layout, causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        comm, layout = ctx.comm, ctx.layout
        cp, me = comm.size, comm.rank
        b, hkv, _, d = k.shape
        per_pos = 2 * b * hkv * d
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # (b, hkv, g, Lq): rowsum(dO * O)
        dq = torch.zeros_like(q)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        arrived = None  # the gradient of the block in hand accumulated by earlier ranks
        for t in range(cp):
            src = (me - t) % cp
            if t < cp - 1:
                incoming = layout.lens[(src - 1) % cp] * per_pos
                nxt, handle = _hop(comm, kv, incoming, f"ring kv backward {t + 1}/{cp - 1}")
            kb, vb = (x.view(b, hkv, -1, d) for x in kv.chunk(2))
            dkv = torch.zeros_like(kv)
            dkb, dvb = (x.view(b, hkv, -1, d) for x in dkv.chunk(2))
            pairs = _pairs(layout.runs[me], layout.runs[src], ctx.causal, q.device)
            _backward_block(q, kb, vb, pairs, ctx.scale, lse, dout, delta, dq, dkb, dvb)
            if arrived is not None:
                arrived[1].wait()
                dkv += arrived[0]
            if cp > 1:  # on to the next holder of this block; after cp hops, its owner
                incoming = layout.lens[(src - 1) % cp] * per_pos
                arrived = _hop(comm, dkv, incoming, f"ring dkv {t + 1}/{cp}")
            if t < cp - 1:
                handle.wait()
                kv = nxt
        if arrived is not None:
            arrived[1].wait()
            dkv = arrived[0]
        dk, dv = (x.view(b, hkv, -1, d) for x in dkv.chunk(2))
        return dq, dk, dv, None, None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    comm: Comm,
    layout: RingLayout,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's ``query`` ``(b, L, h_q, d)`` to the whole sequence, whose
    ``key``/``value`` ``(b, L, h_kv, d)`` (``h_kv`` dividing ``h_q``) are spread over
    ``comm``'s ranks as ``layout`` says; returns ``(b, L, h_q, d)``; differentiable."""
    b, n, hq, d = query.shape
    hkv = key.shape[2]
    if hkv < 1 or hq % hkv:
        raise ValueError(
            f"{hq} query heads cannot share {hkv} key/value heads evenly; grouped-query "
            "attention needs a key/value head count dividing the query heads"
        )
    scale = d**-0.5 if scale is None else float(scale)
    # (b, L, hq, d) -> (b, hkv, g, L, d): query head j uses key/value head j // g
    q = query.float().permute(0, 2, 1, 3).reshape(b, hkv, hq // hkv, n, d).contiguous()
    k, v = (t.float().permute(0, 2, 1, 3).contiguous() for t in (key, value))
    out = _Ring.apply(q, k, v, comm, layout, causal, scale)
    return out.reshape(b, hq, n, d).permute(0, 2, 1, 3).to(query.dtype)
