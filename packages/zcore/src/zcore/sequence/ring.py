"""Ring attention over the ``cp`` axis: each rank keeps its queries, key/value blocks travel.

Every ``cp`` rank holds some positions of each sequence (a :class:`RingLayout`: consecutive
slices, or the load-balanced zig-zag order). Attention runs in ``cp`` steps: at step ``t``
rank ``r`` attends its queries to the key/value block of rank ``r - t`` while that block
already travels on to rank ``r + 1``; the partial results are merged with the online softmax
(each block's output weighted by ``exp(lse_block - lse)``), so no rank ever holds more than
two key/value blocks. Each tile is computed by torch's CPU flash-attention kernel (no score
matrix) or, on other devices, by the written-out arithmetic (one tile's scores at a time):
:mod:`zcore.sequence.ring_blocks`. Unlike Ulysses, nothing is split over heads:
any head count runs at any ``cp`` (``cp`` above the head count included), and with
grouped-query attention only the key/value heads travel.

Causal masks follow the global positions: a query run and a key run are attended in full,
with the diagonal mask, or skipped, so a rank skips every block wholly in its future. With
consecutive slices the last rank does ``cp`` times the first one's work; the zig-zag layout
(rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``, Megatron's CP order) gives
every rank the same work (the diagonal step aside, equal at every step).

The backward is written by hand and passes the blocks around the ring again, each with the
key/value gradient accumulated so far, so it keeps only this rank's ``q, k, v``, output and
log-sum-exp (``O(L)`` per rank) instead of every block's probabilities and received blocks
(``O(L x S)`` and ``O(S)``, what autograd through the blocks would save); the price is the
second pass of key/value blocks (twice the forward's traffic: blocks and their gradients).
Arithmetic is in float32; results are cast back.

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
from zcore.sequence.ring_blocks import Backend, backend_for, tiles

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


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, blk: torch.Tensor) -> None:
    """Fold one tile's ``o`` ``(b, h, n, d)`` and ``blk`` ``(b, h, n)`` into the running
    ``out`` and ``lse`` rows (in place): the online softmax."""
    new = torch.logaddexp(lse, blk)
    out.copy_(out * torch.exp(lse - new)[..., None] + o * torch.exp(blk - new)[..., None])
    lse.copy_(new)


def _hop(comm: Comm, flat: torch.Tensor, incoming: int, what: str) -> tuple[torch.Tensor, Any]:
    """Send ``flat`` to the next rank of the ring and receive ``incoming`` elements from the
    previous one (asynchronous: wait on the returned handle)."""
    n, r = comm.size, comm.rank
    send, recv = [0] * n, [0] * n
    send[(r + 1) % n] = flat.numel()
    recv[(r - 1) % n] = incoming
    out = flat.new_empty(incoming)
    return out, comm.all_to_all_single(out, flat, recv, send, what)


def _expand(kv: torch.Tensor, b: int, hkv: int, group: int, d: int) -> list[torch.Tensor]:
    """A flat ``k ++ v`` block -> ``k``, ``v`` ``(b, h_q, L, d)`` (each key/value head
    repeated for the ``group`` query heads that use it)."""
    return [x.view(b, hkv, -1, d).repeat_interleave(group, dim=1) for x in kv.chunk(2)]


class _Ring(torch.autograd.Function):
    """Ring attention on ``q`` ``(b, h_q, Lq, d)``, ``k``/``v`` ``(b, h_kv, Lk, d)`` (float32,
    contiguous); returns the output ``(b, h_q, Lq, d)``."""

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
        backend: Backend,
    ) -> torch.Tensor:
        cp, me = comm.size, comm.rank
        b, hkv, _, d = k.shape
        group = q.shape[1] // hkv
        per_pos = 2 * b * hkv * d  # elements of k and v per position
        out = torch.zeros_like(q)
        lse = q.new_full(q.shape[:-1], float("-inf"))  # (b, h_q, Lq)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        for t in range(cp):
            src = (me - t) % cp
            if t < cp - 1:
                incoming = layout.lens[(src - 1) % cp] * per_pos
                nxt, handle = _hop(comm, kv, incoming, f"ring kv {t + 1}/{cp - 1}")
            kb, vb = _expand(kv, b, hkv, group, d)
            for tile in tiles(layout.runs[me], layout.runs[src], causal):
                rows, cols = slice(tile.qa, tile.qb), slice(tile.ka, tile.kb)
                o, blk = backend.forward(
                    q[:, :, rows], kb[:, :, cols], vb[:, :, cols], tile.diag, scale
                )
                _merge(out[:, :, rows], lse[:, :, rows], o, blk)
            if t < cp - 1:
                handle.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.layout, ctx.causal, ctx.scale, ctx.backend = (
            comm,
            layout,
            causal,
            scale,
            backend,
        )
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        comm, layout, backend, scale = ctx.comm, ctx.layout, ctx.backend, ctx.scale
        cp, me = comm.size, comm.rank
        b, hkv, _, d = k.shape
        group = q.shape[1] // hkv
        per_pos = 2 * b * hkv * d
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        kv = torch.cat([k.reshape(-1), v.reshape(-1)])
        arrived = None  # the gradient of the block in hand accumulated by earlier ranks
        for t in range(cp):
            src = (me - t) % cp
            if t < cp - 1:
                incoming = layout.lens[(src - 1) % cp] * per_pos
                nxt, handle = _hop(comm, kv, incoming, f"ring kv backward {t + 1}/{cp - 1}")
            kb, vb = _expand(kv, b, hkv, group, d)
            dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)  # (b, h_q, Lk, d)
            for tile in tiles(layout.runs[me], layout.runs[src], ctx.causal):
                rows, cols = slice(tile.qa, tile.qb), slice(tile.ka, tile.kb)
                dqt, dkt, dvt = backend.backward(
                    dout[:, :, rows],
                    q[:, :, rows],
                    kb[:, :, cols],
                    vb[:, :, cols],
                    out[:, :, rows],
                    lse[:, :, rows].contiguous(),
                    tile.diag,
                    scale,
                )
                dq[:, :, rows] += dqt
                dkb[:, :, cols] += dkt
                dvb[:, :, cols] += dvt
            # the query heads' key/value gradients summed onto the heads they share
            dkv = torch.cat([x.view(b, hkv, group, -1, d).sum(2).reshape(-1) for x in (dkb, dvb)])
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
        return dq, dk, dv, None, None, None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    comm: Comm,
    layout: RingLayout,
    *,
    causal: bool = True,
    scale: float | None = None,
    reference: bool = False,
) -> torch.Tensor:
    """Attention of this rank's ``query`` ``(b, L, h_q, d)`` to the whole sequence, whose
    ``key``/``value`` ``(b, L, h_kv, d)`` (``h_kv`` dividing ``h_q``) are spread over
    ``comm``'s ranks as ``layout`` says; returns ``(b, L, h_q, d)``; differentiable.
    ``reference``: compute tiles with the written-out arithmetic instead of torch's CPU
    flash kernel (:mod:`zcore.sequence.ring_blocks`)."""
    hq, d = query.shape[2], query.shape[3]
    hkv = key.shape[2]
    if hkv < 1 or hq % hkv:
        raise ValueError(
            f"{hq} query heads cannot share {hkv} key/value heads evenly; grouped-query "
            "attention needs a key/value head count dividing the query heads"
        )
    scale = d**-0.5 if scale is None else float(scale)
    # (b, L, h, d) -> (b, h, L, d); query head j uses key/value head j // (hq / hkv)
    q, k, v = (t.float().permute(0, 2, 1, 3).contiguous() for t in (query, key, value))
    out = _Ring.apply(q, k, v, comm, layout, causal, scale, backend_for(q.device, reference))
    return out.permute(0, 2, 1, 3).to(query.dtype)
