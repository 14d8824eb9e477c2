"""The capacity path's dispatch: tokens into a fixed ``[E, C]`` slot buffer and back.

DeepSpeed's GShard formulation builds a dense ``[T, E, C]`` one-hot combine tensor and moves
tokens with two einsums, ``O(T*E*C*d)`` work to move ``T*k*d`` numbers. Here each kept route
names its flat slot ``expert * C + location`` and the moves are one ``index_select`` each way
(their backward is an ``index_add``); slots no route fills read a zero row, and routes the
capacity limit dropped point at a scratch slot past the end that reads zero.
"""

from __future__ import annotations

import torch
from torch import Tensor


def route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """[T, k] flat slot of each route in the ``[E * C]`` buffer; ``E * C`` for dropped routes."""
    slots = indices * capacity + locations
    return slots.masked_fill(indices < 0, num_experts * capacity)


def encode(x: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """[E * C, d] buffer holding token ``t`` at the slots of its kept routes, zeros elsewhere."""
    tokens, d = x.shape
    # Invert the routing map: the source token of every slot (``tokens``: the zero pad row).
    source = slots.new_full((num_experts * capacity + 1,), tokens)
    token_ids = torch.arange(tokens, device=slots.device).unsqueeze(1).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), token_ids.reshape(-1))
    padded = torch.cat([x, x.new_zeros(1, d)])
    return padded.index_select(0, source[:-1])


def decode(y: Tensor, slots: Tensor, gates: Tensor) -> Tensor:
    """[T, d]: the sum over each token's routes of its slot's output times the route's weight.

    ``gates`` is fp32, so the weighted sum accumulates in fp32 (as DeepSpeed's combine does)
    before the cast back to ``y``'s dtype.
    """
    tokens, k = slots.shape
    padded = torch.cat([y, y.new_zeros(1, y.shape[1])])
    routed = padded.index_select(0, slots.reshape(-1)).view(tokens, k, -1)
    return (routed * gates.unsqueeze(-1)).sum(dim=1).to(y.dtype)
