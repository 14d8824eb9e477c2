"""ZB-V's weight pass over checkpointed layers as one graph task: the same weight gradients
as torch's per-group calls, bit for bit, with each checkpointed layer recomputed once for it
(torch's recomputes it once per parameter group). One process; the schedules' equivalence
with single-process training is in test_pipe_train.py and test_pipe_stage3.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import checkpoint

from zcore.pipe.weight_pass import weight_grads_at_once


class _Block(nn.Module):
    """Three parameter groups (a norm and two linears) on one residual path."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        self.calls += 1
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _weight_pass(blocks: nn.ModuleList, split: object, checkpointed: bool) -> list[torch.Tensor]:
    """Input pass, then ``split``'s weight pass; every weight's gradient."""
    torch.manual_seed(1)
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = x
    for b in blocks:
        out = checkpoint(b, out, use_reentrant=False) if checkpointed else b(out)
    grad = torch.randn_like(out)
    params = list(blocks.parameters())
    _, groups = stage_backward_input([out], [grad], [x], iter(params))
    for b in blocks:
        b.calls = 0  # count the weight pass's recomputes only
    assert len(groups) == 3 * len(blocks)
    split(params, groups)  # type: ignore[operator]
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


@pytest.mark.parametrize("checkpointed", [True, False])
def test_one_graph_task_gives_torchs_weight_gradients(checkpointed: bool) -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block(8) for _ in range(3))
    theirs = _weight_pass(blocks, lambda ps, gs: stage_backward_weight(iter(ps), gs), checkpointed)
    torch_calls = [b.calls for b in blocks]
    ours = _weight_pass(blocks, weight_grads_at_once, checkpointed)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    if checkpointed:  # a recompute per parameter group in torch's, one in ours
        assert torch_calls == [3, 3, 3]
        assert [b.calls for b in blocks] == [1, 1, 1]


def test_adds_to_gradients_already_there() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block(8) for _ in range(2))
    once = _weight_pass(blocks, weight_grads_at_once, True)
    for p, g in zip(blocks.parameters(), once, strict=True):
        p.grad = g.clone()  # an earlier micro-batch's
    twice = _weight_pass(blocks, weight_grads_at_once, True)
    assert all(torch.equal(t, o + o) for t, o in zip(twice, once, strict=True))
