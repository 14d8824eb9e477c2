"""The router: which experts each token goes to, with what weight, and the balancing losses.

Softmax top-1 and top-2 follow DeepSpeed's ``top1gating`` / ``top2gating``
(``deepspeed/moe/sharded_moe.py``, 0.19.8) step for step, so with the same gate weight they
pick the same experts, keep the same tokens under a capacity limit, and return the same
``l_aux`` and ``exp_counts``; top-k (k >= 3) follows its ``topkgating`` (``drop_policy
"probs"``). Sigmoid scores and the aux-loss-free bias (DeepSeek-V3) go through the same
top-k path with the selection scores changed.

Every router returns a :class:`Routing`: ``k`` routes per token (expert index, combine
weight, slot in that expert's capacity buffer), a route the capacity limit evicted having
expert ``-1`` and weight 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROUTERS = ("softmax", "sigmoid")
NOISY_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass
class Routing:
    """What the router decided for ``T`` tokens and ``k`` routes per token."""

    indices: Tensor
    """[T, k] int64 global expert of each route; -1 where the capacity limit dropped it."""
    gates: Tensor
    """[T, k] fp32 combine weight of each route (0 where dropped)."""
    locations: Tensor
    """[T, k] int64 slot of each kept route in its expert's capacity buffer (token order)."""
    capacity: int
    """Slots per expert on the capacity path; 0 on the dropless path."""
    l_aux: Tensor
    """Load-balancing loss (DeepSpeed's formula for the chosen k)."""
    z_loss: Tensor
    """Router z-loss, ``mean(logsumexp(logits)^2)`` (ST-MoE), unscaled."""
    exp_counts: Tensor
    """[E] routes chosen per expert before the capacity limit (DeepSpeed's ``exp_counts``)."""


def capacity_for(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """DeepSpeed's ``_capacity``: ``max(ceil(tokens / experts * factor), min_capacity)``."""
    return max(math.ceil(tokens / experts * factor), min_capacity)


def _gumbel(shape: torch.Size, like: Tensor) -> Tensor:
    u = torch.rand(shape, device=like.device, dtype=like.dtype)
    return -torch.log(-torch.log(u.clamp_min(1e-20)).clamp_min(1e-20))


def _per_route(mask: Tensor, idx: Tensor, locations: Tensor, gates: Tensor) -> tuple[Tensor, ...]:
    """[T, E] kept-mask/locations/gates, read at the [T, k] chosen experts ``idx``."""
    kept = mask.gather(1, idx).bool()
    indices = torch.where(kept, idx, torch.full_like(idx, -1))
    return indices, (locations.gather(1, idx) * kept).long(), gates.gather(1, idx) * kept


def top1(
    logits: Tensor,
    probs: Tensor,
    capacity: int | None,
    use_rts: bool,
    rsample: bool,
    used_token: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """DeepSpeed's ``top1gating`` (``capacity=None``: no token is dropped)."""
    tokens, experts = probs.shape
    select = logits + _gumbel(logits.shape, logits) if rsample else probs
    idx = select.argmax(dim=1)
    mask = F.one_hot(idx, experts)  # [T, E]
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.sum(probs.mean(dim=0) * mask.float().mean(dim=0)) * experts
    if capacity is not None:
        # Which tokens keep their slot: the first `capacity` by torch.topk over the mask,
        # exactly as DeepSpeed (random priorities with Random Token Selection).
        priority = mask * torch.rand_like(probs) if use_rts else mask
        top = torch.topk(priority, k=min(capacity, tokens), dim=0)[1]
        mask = mask * torch.zeros_like(mask).scatter_(0, top, 1)
    locations = torch.cumsum(mask, dim=0) - 1
    gates = probs * mask
    indices, locs, weights = _per_route(mask, idx[:, None], locations, gates)
    return indices, locs, weights, l_aux, exp_counts


def top2(
    logits: Tensor, probs: Tensor, capacity: int | None, second_sampling: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """DeepSpeed's ``top2gating``: the 2nd expert is the best other logit (Gumbel-sampled
    with ``second_sampling``); weights are renormalized over the kept routes."""
    experts = probs.shape[1]
    idx1 = probs.argmax(dim=1)
    mask1 = F.one_hot(idx1, experts)
    second = logits + _gumbel(logits.shape, logits) if second_sampling else logits
    idx2 = second.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1)
    mask2 = F.one_hot(idx2, experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(probs.mean(dim=0) * mask1.float().mean(dim=0)) * experts * experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if capacity is not None:
        mask1 = mask1 * (loc1 < capacity)
        mask2 = mask2 * (loc2 < capacity)
    g1 = (probs * mask1).sum(dim=1)
    g2 = (probs * mask2).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    idx = torch.stack([idx1, idx2], dim=1)
    kept = torch.stack([mask1.gather(1, idx1[:, None]), mask2.gather(1, idx2[:, None])], 1)[..., 0]
    kept = kept.bool()
    indices = torch.where(kept, idx, torch.full_like(idx, -1))
    locs = torch.stack([(loc1 * mask1).sum(dim=1), (loc2 * mask2).sum(dim=1)], dim=1)
    weights = torch.stack([g1 / denom, g2 / denom], dim=1)
    return indices, locs.long(), weights, l_aux, exp_counts


def topk(
    scores: Tensor, select: Tensor, share: Tensor, k: int, capacity: int | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """DeepSpeed's ``topkgating`` (``drop_policy="probs"``: over capacity, an expert keeps its
    highest-weight routes). ``select`` ranks the experts (``scores`` plus any bias),
    ``scores`` give the weights (renormalized over the kept routes when k > 1) and
    ``share`` (each token's scores summing to 1) the balancing loss."""
    tokens, experts = scores.shape
    idx = torch.topk(select, k=k, dim=1)[1]
    top_scores = scores.gather(1, idx)
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(share.mean(dim=0) * mask.float().mean(dim=0)) * experts * experts / k
    if capacity is not None:
        ranked = torch.zeros_like(scores).scatter(1, idx, top_scores)
        keep = torch.topk(ranked, k=min(capacity, tokens), dim=0, sorted=False)[1]
        mask &= torch.zeros_like(mask).scatter_(0, keep, True)
    locations = torch.cumsum(mask, dim=0) - 1
    gates = scores * mask
    if k > 1:
        gates = gates / torch.clamp(
            gates.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps
        )
    indices, locs, weights = _per_route(mask, idx, locations, gates)
    return indices, locs, weights, l_aux, exp_counts


class TopKRouter(nn.Module):
    """The gate: a bias-free linear ``wg`` (hidden -> experts, run in fp32) and the routing
    rule. ``expert_bias`` (aux-loss-free balancing) is a buffer, used for selection only."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
        router: str = "softmax",
        aux_loss_free_bias: bool = False,
    ) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden_size, num_experts, bias=False)
        self.num_experts = num_experts
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.router = router
        self.aux_loss_free_bias = aux_loss_free_bias
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=aux_loss_free_bias)

    def forward(self, x: Tensor, used_token: Tensor | None = None) -> Routing:
        """Route ``x`` [T, hidden] (any dtype; the gate computes in fp32)."""
        x32 = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x32 = x32 * torch.empty_like(x32).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(x32, self.wg.weight.float())  # [T, E]
        tokens = logits.shape[0]
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        capacity = None
        if self.drop_tokens:
            capacity = capacity_for(tokens, self.num_experts, factor * self.k, self.min_capacity)
        if used_token is not None and self.k != 1:
            raise ValueError(f"used_token is supported with k=1 only (as DeepSpeed); k is {self.k}")
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        if self.router == "softmax" and not self.aux_loss_free_bias and self.k <= 2:
            probs = F.softmax(logits, dim=1)
            if self.k == 1:
                rsample = self.noisy_gate_policy == "RSample" and self.training
                use_rts = self.use_rts and self.training
                out = top1(logits, probs, capacity, use_rts, rsample, used_token)
            else:
                sampling = self.top2_2nd_expert_sampling and self.training
                out = top2(logits, probs, capacity, sampling)
        else:
            if used_token is not None:
                raise ValueError("used_token is not supported with a sigmoid router or expert_bias")
            if self.router == "softmax":
                scores = share = F.softmax(logits, dim=1)
            else:
                scores = torch.sigmoid(logits)
                share = scores / scores.sum(dim=1, keepdim=True)
            select = scores + self.expert_bias if self.aux_loss_free_bias else scores
            out = topk(scores, select.detach(), share, self.k, capacity)
        indices, locations, gates, l_aux, exp_counts = out
        return Routing(indices, gates, locations, capacity or 0, l_aux, z_loss, exp_counts)

    @torch.no_grad()
    def update_bias(self, load: Tensor, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free step: raise the bias of under-loaded experts and lower
        it for over-loaded ones by ``rate`` (sign of the load error), ``load`` [E] routes."""
        load = load.float()
        self.expert_bias += rate * torch.sign(load.mean() - load)
