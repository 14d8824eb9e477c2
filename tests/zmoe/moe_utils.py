"""Small MoE setups shared by the zmoe tests."""

from __future__ import annotations

import torch
from torch import nn

import zmoe


def mlp(d: int, ffn: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d))


def seed_experts(layer: zmoe.MoE, seed: int = 0) -> None:
    """Give every expert distinct weights, a function of its global index only (so a layer
    at any ep_size gets the same expert ``g``)."""
    for name, expert in layer.experts.items():
        gen = torch.Generator().manual_seed(seed * 1000 + int(name))
        with torch.no_grad():
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def build(d: int = 16, ffn: int = 32, experts: int = 4, **kwargs: object) -> zmoe.MoE:
    torch.manual_seed(0)
    layer = zmoe.MoE(d, mlp(d, ffn), num_experts=experts, **kwargs)  # type: ignore[arg-type]
    seed_experts(layer)
    return layer
