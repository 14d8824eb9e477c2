"""Stage 3 under activation checkpointing: a checkpointed region's activations are freed when
its forward ends (no reference cycle holds a module's outputs until the garbage collector
runs), and the run trains like the same model without ZeRO, to fp32 summation order.

The model computes its loss over tiles of tokens, each under non-reentrant checkpointing (as
ALST's tiled loss does): only the loss leaves a tile, so each tile's logits, an output of the
ZeRO-3 head, must be gone once the tile's forward returns, with the collector off.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zcore
from tests.utils.distributed import run_ranks
from tests.zcore.zero.common import config

VOCAB, DIM, SEQ, TILES, STEPS = 61, 24, 12, 3, 3


class TiledLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def _tile(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.tanh(self.fc(h))), y, reduction="sum")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).reshape(-1, DIM)
        tiles = zip(h.tensor_split(TILES), targets.reshape(-1).tensor_split(TILES), strict=True)
        total = sum(checkpoint(self._tile, a, b, use_reentrant=False) for a, b in tiles)
        return total / targets.numel()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)[2 * rank : 2 * rank + 2]
    return data[:, :-1], data[:, 1:]


def _rank(rank: int, world: int) -> dict[str, Any]:
    model = TiledLM()
    logits: list[weakref.ref] = []
    model.head.register_forward_hook(lambda m, a, out: logits.append(weakref.ref(out)))
    cfg = config(3, gas=1, zero_optimization={"stage3_param_persistence_threshold": 0})
    engine, *_ = zcore.initialize(model, config=cfg)
    losses, alive = [], []
    gc.disable()  # what frees the tiles must be reference counting alone
    try:
        for step in range(STEPS):
            loss = engine(*_batch(step, rank))
            alive.append(sum(r() is not None for r in logits))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            logits.clear()
    finally:
        gc.enable()
    return {"losses": losses, "alive": alive}


def _baseline() -> list[float]:
    """The same steps without ZeRO: one process, both ranks' rows, torch's AdamW."""
    model = TiledLM()
    cfg = config(3)
    opt = torch.optim.AdamW(model.parameters(), **cfg["optimizer"]["params"])
    losses = []
    for step in range(STEPS):
        pairs = [_batch(step, r) for r in range(2)]
        loss = sum(model(x, y) for x, y in pairs) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["gradient_clipping"])
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_checkpointed_tiles_free_their_activations_and_train_like_plain_torch() -> None:
    results = run_ranks(_rank, 2, timeout=120)
    for r in results:
        assert r["alive"] == [0] * STEPS, r["alive"]  # no tile's logits outlive its forward
    mean = [sum(v) / 2 for v in zip(*(r["losses"] for r in results), strict=True)]
    want = _baseline()
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(want), rtol=1e-5, atol=1e-6)
