"""Every local expert takes part in backward, also with no tokens routed to it.

Under ZeRO every rank must produce the same parameters' gradients in the same order (the
reducer's buckets, stage 3's gathers): an expert that got tokens on one rank and none on
another must still get a (zero) gradient on the second.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zmoe


class SwiGLU(nn.Module):  # not Linear-activation-Linear: run as one module call per expert
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@pytest.mark.parametrize("tokens", [0, 3])
@pytest.mark.parametrize("expert", ["swiglu", "mlp"])
def test_every_expert_gets_a_gradient(tokens: int, expert: str) -> None:
    torch.manual_seed(0)
    d = 8
    module = (
        SwiGLU(d, 16)
        if expert == "swiglu"
        else nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))
    )
    layer = zmoe.MoE(d, module, num_experts=8, k=1, drop_tokens=False)
    x = torch.randn(tokens, d, requires_grad=True)
    out, l_aux, _ = layer(x)
    (out.sum() + l_aux).backward()
    load = layer.last_stats.expert_load if layer.last_stats is not None else None
    assert tokens == 0 or (load is not None and int((load == 0).sum()) > 0)  # some idle
    for name, p in layer.experts.named_parameters():
        assert p.grad is not None, name
