"""Mixtral's sparse mixture-of-experts block, over the packed tokens of a ragged batch.

A Mixtral layer is a LLaMA layer whose SwiGLU MLP is replaced by ``num_local_experts``
SwiGLU experts and a router. Routing follows transformers' ``MixtralSparseMoeBlock``
op for op: router logits in the model dtype, softmax in fp32, top-``num_experts_per_tok``,
the chosen probabilities renormalised to sum to 1, each expert's output scaled by its
weight in fp32 and summed in the model dtype.

The block sees every token of every sequence of the step at once (prompt chunks and
decodes alike: routing is per token, so sequence boundaries do not matter). The
``T * top_k`` token-slots are sorted by expert so each expert runs one gate/up GEMM and
one down GEMM on its contiguous slice; ``index_add_`` scatters the weighted results
back to their tokens.

Two weight layouts are read: the Mixtral checkpoint names
(``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1/w2/w3``, which
transformers' ``save_pretrained`` writes) and transformers-5's in-memory fused names
(``mlp.gate``, ``mlp.experts.gate_up_proj (E, 2I, H)``, ``mlp.experts.down_proj (E, H, I)``,
as in a saved ``state_dict()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from zserve.model.config import LlamaConfig

if TYPE_CHECKING:
    from zserve.model.weights import WeightLoader


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights: ``x (T, H)``, ``router (E, H)`` →
    fp32 weights ``(T, top_k)`` summing to 1 per token, int64 expert ids ``(T, top_k)``."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)  # (T, E)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


@dataclass
class SparseMoE:
    """One layer's router and experts, gate and up fused per expert."""

    router: torch.Tensor
    """``(E, hidden)``: the ``gate`` linear, one logit per expert."""
    gate_up: torch.Tensor
    """``(E, 2 I, hidden)``: each expert's ``w1`` (gate) rows, then its ``w3`` (up) rows."""
    down: torch.Tensor
    """``(E, hidden, I)``: each expert's ``w2``."""
    top_k: int
    """Experts per token."""
    first: int = 0
    """Router index of ``gate_up[0]``: a tensor-parallel rank holds experts ``first ..
    first + len(gate_up)`` (:mod:`zserve.tp`) and returns their part of the sum."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output ``(T, hidden)`` for the normed tokens ``x (T, hidden)``."""
        weights, experts = route(x, self.router, self.top_k)  # (T, k) each
        flat = experts.reshape(-1)  # (T * k,): slot s is token s // k's choice s % k
        order = flat.argsort(stable=True)  # slots grouped by expert, token order within
        counts = torch.bincount(flat, minlength=self.router.shape[0]).tolist()
        held = counts[self.first : self.first + self.gate_up.shape[0]]
        if len(held) != len(counts):  # only the held experts' slots
            lo = sum(counts[: self.first])
            order = order[lo : lo + sum(held)]
        tokens = order // self.top_k  # (T * k,) the token of each sorted slot
        xs = x.index_select(0, tokens)  # (T * k, hidden), contiguous per expert
        outs: list[torch.Tensor] = []
        start = 0
        for e, n in enumerate(held):
            if n:
                gate, up = F.linear(xs[start : start + n], self.gate_up[e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, self.down[e]))  # (n, hidden)
            start += n
        if not outs:  # no token chose a held expert
            return torch.zeros_like(x)
        # Scaled in fp32 and cast back before the sum, as transformers does.
        ys = (torch.cat(outs) * weights.reshape(-1, 1).index_select(0, order)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, ys)

    @classmethod
    def load(cls, load: WeightLoader, prefix: str, config: LlamaConfig) -> SparseMoE:
        """The block of the layer whose tensors start with ``prefix`` (``model.layers.{i}.``),
        from either weight layout."""
        c = config
        e, h, inter = c.num_local_experts, c.hidden_size, c.intermediate_size
        # a tensor-parallel rank's checkpoint names the experts it holds (zserve.tp)
        first, last = getattr(load.checkpoint, "experts", None) or (0, e)
        fused = prefix + "mlp.experts."
        if fused + "gate_up_proj" in load:
            return cls(
                router=load(prefix + "mlp.gate.weight", e, h),
                gate_up=load(fused + "gate_up_proj", e, 2 * inter, h)[first:last].contiguous(),
                down=load(fused + "down_proj", e, h, inter)[first:last].contiguous(),
                top_k=c.num_experts_per_tok,
                first=first,
            )
        moe = prefix + "block_sparse_moe."
        expert = [f"{moe}experts.{j}." for j in range(first, last)]
        return cls(
            router=load(moe + "gate.weight", e, h),
            gate_up=torch.stack(
                [load.cat([p + "w1.weight", p + "w3.weight"], [(inter, h)] * 2) for p in expert]
            ),
            down=torch.stack([load(p + "w2.weight", h, inter) for p in expert]),
            top_k=c.num_experts_per_tok,
            first=first,
        )
