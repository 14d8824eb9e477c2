"""A small GPT-like layer stack for pipeline tests, its data, and the single-process baseline.

The model is ``PipelineModule`` layers: embedding, residual MLP blocks, a final norm and an
output head (tied to the embedding, or its own linear). ``seed_layers=True`` seeds layer
``i`` with ``base_seed + i``, so one process building every layer (``num_stages=1``) gets the
same initial weights as the stages of a pipeline, and the same parameter names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zcore.pipe import LayerSpec, PipelineModule, TiedLayerSpec

VOCAB, DIM, SEQ = 61, 24, 8
LR = 3e-3


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


def head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The output head reading the tied embedding's weight: (B, T, D) -> (B, T, V)."""
    return x @ embedding.weight.t()


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def layers(blocks: int = 4, tied: bool = True) -> list[Any]:
    out: list[Any] = [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM)]
    out += [LayerSpec(Block) for _ in range(blocks)]
    out.append(LayerSpec(nn.LayerNorm, DIM))
    if tied:
        out.append(TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head))
    else:
        out.append(LayerSpec(nn.Linear, DIM, VOCAB, bias=False))
    return out


def make_pipe(stages: int, blocks: int = 4, tied: bool = True, **kw: Any) -> PipelineModule:
    return PipelineModule(
        layers(blocks, tied), num_stages=stages, loss_fn=loss_fn, seed_layers=True, **kw
    )


def config(stage: int, *, mb: int = 2, gas: int = 4, schedule: str = "1f1b", **extra: Any) -> dict:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        "pipeline": {"schedule": schedule},
        "comm_timeout_s": 60,
    }
    cfg.update(extra)
    return cfg


def micro_batches(step: int, dp: int, mb: int, gas: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """Step ``step``'s micro-batches ``[data rank][micro] -> (x, y)``."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (dp * gas * mb, SEQ + 1), generator=g)
    out = []
    for d in range(dp):
        ms = []
        for i in range(gas):
            rows = data[(d * gas + i) * mb : (d * gas + i + 1) * mb]
            ms.append((rows[:, :-1], rows[:, 1:]))
        out.append(ms)
    return out


def baseline(
    steps: int, dp: int, mb: int, gas: int, blocks: int = 4, tied: bool = True
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process fp32 training of the same layers on the same micro-batches."""
    model = make_pipe(1, blocks, tied)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for ms in micro_batches(step, dp, mb, gas):
            for x, y in ms:
                loss = loss_fn(model(x), y) / (dp * gas)
                loss.backward()
                total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def train(engine: Any, steps: int, mb: int, gas: int) -> list[float]:
    dp, d = engine.world_size, engine.data_rank
    return [
        float(engine.train_batch(iter(micro_batches(step, dp, mb, gas)[d])))
        for step in range(steps)
    ]


def local_params(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}
