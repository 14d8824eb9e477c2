"""Tiny real setups for engine tests: a small tied-embedding LM, fixed data, a plain baseline."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ = 61, 24, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 2 * DIM)
        self.proj = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class TinyLM(nn.Module):
    """Embedding → 2 residual MLP blocks → LayerNorm → head tied to the embedding."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def micro_batch(step: int, micro: int, rank: int, world: int, mb: int, gas: int) -> Any:
    """Rank ``rank``'s ``micro``-th slice of step ``step``'s global batch (world-size invariant)."""
    x, y = global_batch(step, mb * world * gas)
    i = (micro * world + rank) * mb
    return x[i : i + mb], y[i : i + mb]


def config(stage: int, *, mb: int = 2, gas: int = 2, clip: float = 0.5, **extra: Any) -> dict:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 500,
            "allgather_bucket_size": 700,
            "stage3_param_persistence_threshold": 30,
            "stage3_prefetch_bucket_size": 3000,
        },
        "comm_timeout_s": 60,
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def baseline(
    steps: int,
    global_size: int,
    clip: float = 0.5,
    start: int = 0,
    model: Any = None,
    opt_state: Any = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Unsharded single-process fp32 training on the same global batches."""
    model = copy.deepcopy(model) if model is not None else make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(start, start + steps):
        x, y = global_batch(step, global_size)
        loss = model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's model, whole and fp32, on every rank."""
    from zcore.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def train(engine: Any, steps: int, start: int = 0, *, fail: Any = None) -> list[float]:
    """``steps`` optimizer steps; returns the global-batch mean loss of each step."""
    import torch.distributed as dist

    gas = engine.batch.gradient_accumulation_steps
    mb = engine.batch.micro_batch_size
    losses = []
    for step in range(start, start + steps):
        total = torch.zeros(1)
        for micro in range(gas):
            x, y = micro_batch(step, micro, engine.rank, engine.world_size, mb, gas)
            loss = engine(x, y)
            if fail is not None:
                loss = fail(step, micro, loss)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(float(total) / (gas * engine.world_size))
    return losses
