"""The capacity path's dispatch: tokens into a fixed ``[E, C]`` slot buffer and back.

DeepSpeed's GShard formulation builds a dense ``[T, E, C]`` one-hot combine tensor and moves
tokens with two einsums, ``O(T*E*C*d)`` work to move ``T*k*d`` numbers. Here each kept route
names its flat slot ``expert * C + location`` and the moves are one row gather each way;
slots no route fills read a zero row, and routes the capacity limit dropped point at a
scratch slot past the end that reads zero.

Both gathers' backwards are gathers too (:class:`_Gather`): the map from slots to routes is
inverted once, so no backward runs ``index_select``'s own backward, an ``index_add_`` that
CPU torch runs as a serial ``scatter_add_`` (profiled at 2 x 115 ms of a ~1.5 s training
step of the default ``z bench moe`` layer under load, more than a third of its expert GEMMs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _padded(x: Tensor) -> Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


class _Gather(torch.autograd.Function):
    """``out[i] = src[index[i]]`` (``index[i] == len(src)``: a zero row) whose backward is
    ``grad_src[j] = sum_m grad[back[j, m]]`` (``back[j, m] == len(index)``: nothing)."""

    @staticmethod
    def forward(ctx: Any, src: Tensor, index: Tensor, back: Tensor, pad: bool) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(back)
        return (_padded(src) if pad else src).index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (back,) = ctx.saved_tensors
        rows, fan = back.shape
        picked = _padded(grad).index_select(0, back.reshape(-1))
        out = picked if fan == 1 else picked.view(rows, fan, -1).sum(dim=1)
        return out.view(rows, *grad.shape[1:]), None, None, None


def route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """[T, k] flat slot of each route in the ``[E * C]`` buffer; ``E * C`` for dropped routes."""
    slots = indices * capacity + locations
    return slots.masked_fill(indices < 0, num_experts * capacity)


def slot_routes(slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """[E * C] the route ``t * k + j`` filling each slot; ``T * k`` for an empty slot."""
    routes = slots.new_full((num_experts * capacity + 1,), slots.numel())
    routes.scatter_(0, slots.reshape(-1), torch.arange(slots.numel(), device=slots.device))
    return routes[:-1]


def encode(x: Tensor, slots: Tensor, routes: Tensor) -> Tensor:
    """[E * C, d] buffer holding token ``t`` at the slots of its kept routes, zeros elsewhere
    (``routes`` from :func:`slot_routes`)."""
    k = slots.shape[1]
    source = torch.div(routes, k, rounding_mode="floor")  # token of each slot; T: empty
    return _Gather.apply(x, source, slots, True)


def decode(y: Tensor, slots: Tensor, routes: Tensor, gates: Tensor) -> Tensor:
    """[T, d]: the sum over each token's routes of its slot's output times the route's weight.

    ``gates`` is fp32, so the weighted sum accumulates in fp32 (as DeepSpeed's combine does)
    before the cast back to ``y``'s dtype. A dropped route (slot ``E * C``, gate 0) reads
    slot 0 instead of a zero row, which its zero gate cancels (no padded copy of ``y``).
    """
    tokens, k = slots.shape
    index = slots.reshape(-1).clamp_max(y.shape[0] - 1)
    routed = _Gather.apply(y, index, routes.unsqueeze(1), False).view(tokens, k, -1)
    return (routed * gates.unsqueeze(-1)).sum(dim=1).to(y.dtype)
