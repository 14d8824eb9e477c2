"""1-bit Adam's weight all-gather at ZeRO stages 1-2: the owners' updates replayed, not sent.

After the freeze, a 1-bit Adam owner's update of its slot is ``lr * (m / d + wd * p)`` with
``d = sqrt(v) + eps`` frozen. If ``m`` itself is 1-bit (signs times one scale per block of
:data:`BLOCK` elements, DeepSpeed's "server" compression of the momentum, with its error
kept for the next step), then the update is fully described by those signs and scales: the
owner sends them (1/32 of the fp32 slot plus 4 bytes per block), every rank holds every
slot's ``d`` (all-gathered once when the variance freezes) and the model's own copy of the
weights, and replays each owner's update with the same float operations in the same order
(:func:`replay`). The result is the owner's master bit for bit: nothing is approximated
beyond the momentum compression stage 0's 1-bit Adam already does. This replaces an fp32
all-gather as large as an fp32 all-reduce's second half.

The optimizer's side is :class:`ReplayedGather`.
"""

from __future__ import annotations

from typing import Any

import torch

from zcomm.kernels import pack_signs, unpack_signs

BLOCK = 2048
"""Elements per momentum scale (4 bytes per 2048 one-bit elements: +1.6% bytes)."""


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """The root mean square of each :data:`BLOCK` of ``x`` (1-D fp32), the last block over
    its real elements only; the scale each block's signs stand for."""
    n = x.numel()
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = x
    scales = padded.view(blocks, BLOCK).square().mean(1).sqrt()
    scales[-1] = x[(blocks - 1) * BLOCK :].square().mean().sqrt()
    return scales


def expand(scales: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Per-element scales of columns ``start .. start + n`` of a slot, from the scales of
    its blocks ``start // BLOCK ..`` (``scales[0]`` is that first block's)."""
    first = start // BLOCK
    cols = torch.arange(start, start + n, device=scales.device)
    return scales[cols // BLOCK - first]


def compress(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(signs, scales, value)``: ``x``'s packed signs, its block scales, and the value
    they stand for (``+-scale``), computed exactly as a receiver decodes it."""
    signs, scales = pack_signs(x), block_scales(x)
    return signs, scales, decode(signs, scales, 0, x.numel())


def decode(signs: torch.Tensor, scales: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """``n`` columns from ``start`` as ``+-scale``: ``signs`` are theirs, ``scales`` those of
    the blocks they touch, in order."""
    return unpack_signs(signs, n).mul_(expand(scales, start, n))


def block_range(start: int, n: int) -> slice:
    """The blocks columns ``start .. start + n`` of a slot touch."""
    return slice(start // BLOCK, -(-(start + n) // BLOCK))


def replay(
    p: torch.Tensor, m: torch.Tensor, d: torch.Tensor, lr: float, weight_decay: float
) -> torch.Tensor:
    """``p - lr * (m / d + weight_decay * p)`` as new tensors, one rounding per operation
    in a fixed order (no fused multiply-add), so that an owner stepping its slot and every
    rank replaying it from the same inputs get the same bits, row by row or whole."""
    update = m / d
    if weight_decay > 0:
        update = update + p * weight_decay
    return p - update * lr


class ReplayedGather:
    """The optimizer side of a replayed weight all-gather (zcore's ``CompressedGather``),
    mixed into a :class:`~zcomm.optim.base.OneBitBase` subclass (1-bit Adam's).

    In its step an owner calls :meth:`compress_momentum` on the momentum it is about to
    apply, steps with the compressed value, and calls :meth:`note_step`;
    :meth:`gather_slots` sends the signs and block scales and replays
    :func:`replay` for every slot. The momentum's error buffer per group is checkpointed
    per rank (:meth:`replay_state` / :meth:`load_replay_state`).

    Tried and dropped for 0/1 Adam (measured on z train, tiny, stage 2): replaying its
    1-bit local-step momentum (or its update ``m / d``) and its synchronization's weight
    correction diverged after the variance froze (validation loss 5.28 at the freeze,
    then 6.2-9.8), where the fp32 gather reaches 4.62.
    """

    def init_replay(self) -> None:
        self.errors: dict[int, torch.Tensor] = {}
        """Per group: what the momentum's compression dropped, carried to the next step."""
        self._sent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lr_wd: dict[int, tuple[float, float]] = {}

    def begin_step(self) -> None:
        """Forget the previous step: a publish replays only the step just taken."""
        self._sent.clear()

    def compress_momentum(self, gi: int, m: torch.Tensor, seen: torch.Tensor) -> None:
        """Replace group ``gi``'s momentum ``m`` (in place) by its 1-bit form with error
        feedback, zero where ``seen`` (``v > 0``) is False; keep it for :meth:`gather_slots`."""
        flat, mask = m.view(-1), seen.view(-1)
        err = self.errors.get(gi)
        if err is None:
            err = self.errors[gi] = torch.zeros_like(flat)
        total = flat + err
        _, scales, value = compress(total)
        err.copy_(total - value).mul_(mask)
        flat.copy_(value).mul_(mask)
        self._sent[gi] = (flat.clone(), scales)

    def note_step(self, gi: int, lr: float, weight_decay: float) -> None:
        self._lr_wd[gi] = (lr, weight_decay)

    def gather_slots(self, held: torch.Tensor, key: str, group: int, offset: int) -> torch.Tensor:
        """zcore's ``CompressedGather``: every owner's momentum for these columns,
        all-gathered as signs and block scales, and every owner's update replayed on
        ``held``; this rank's master columns set to its own row."""
        comm = self.context.comm  # type: ignore[attr-defined]
        world, n, device = comm.size, held.shape[1], held.device
        cols = slice(offset, offset + n)
        m_slot, all_scales = self._sent[group]
        scales = all_scales[block_range(offset, n)]
        signs = pack_signs(m_slot[cols])
        send = torch.cat([signs, scales.view(torch.uint8)])
        recv = torch.empty(world * send.numel(), dtype=torch.uint8, device=device)
        comm.all_gather(recv, send, f"all_gather(1-bit momentum `{key}`)").wait()
        rows = recv.view(world, -1)
        m = torch.empty(world, n, dtype=torch.float32, device=device)
        got = torch.empty(4 * scales.numel(), dtype=torch.uint8, device=device)
        for r in range(world):
            got.copy_(rows[r, signs.numel() :])  # aligned for the fp32 view
            m[r] = decode(rows[r, : signs.numel()], got.view(torch.float32), offset, n)
        d_grid, seen = self.denominator_grid(group)  # type: ignore[attr-defined]
        m.mul_(seen[:, cols])
        lr, wd = self._lr_wd[group]
        out = replay(held.float(), m, d_grid[:, cols], lr, wd)
        master = self.param_groups[group]["params"][0]  # type: ignore[attr-defined]
        master.view(-1)[cols].copy_(out[comm.rank])
        self.gather_bytes += send.numel()  # type: ignore[attr-defined]
        return out

    def replay_state(self) -> dict[int, torch.Tensor]:
        return {gi: e.clone() for gi, e in self.errors.items()}

    def load_replay_state(self, state: dict[str, Any] | None) -> None:
        saved = {} if state is None else state.get("replay") or {}
        self.errors = {int(gi): e.clone() for gi, e in saved.items()}
