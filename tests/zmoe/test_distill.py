"""Mixture-of-Students: a shallower MoE student cut from an MoE teacher and distilled from it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zmoe
from tests.zmoe.moe_utils import mlp
from zmoe.distill import StagedKD, kd_loss, student_from_teacher

VOCAB, D, SEQ = 32, 16, 12


class TinyMoELM(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(
            zmoe.MoE(D, mlp(D, 2 * D), num_experts=4, k=2, drop_tokens=False) for _ in range(layers)
        )
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            h, _, _ = block(x.reshape(-1, D))
            x = x + h.view_as(x)
        return self.head(x)


def _data(seed: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of a fixed random bigram chain (something a model can learn)."""
    g = torch.Generator().manual_seed(1234)
    table = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 3, dim=-1)
    g.manual_seed(seed)
    seq = torch.empty(n, SEQ + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        seq[:, t + 1] = torch.multinomial(table[seq[:, t]], 1, generator=g).squeeze(1)
    return seq[:, :-1], seq[:, 1:]


def test_kd_loss_is_ce_plus_scaled_kl() -> None:
    torch.manual_seed(0)
    s, t = torch.randn(3, 5, VOCAB, requires_grad=True), torch.randn(3, 5, VOCAB)
    y = torch.randint(0, VOCAB, (3, 5))
    y[0, 0] = -100
    ce = F.cross_entropy(s.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(kd_loss(s, t, y, alpha=0.0), ce)
    temp, keep = 2.0, y.reshape(-1) != -100
    p_t = torch.softmax(t.reshape(-1, VOCAB)[keep] / temp, -1)
    log_s = torch.log_softmax(s.reshape(-1, VOCAB)[keep] / temp, -1)
    kl = (p_t * (p_t.log() - log_s)).sum(-1).mean()
    want = 0.7 * ce + 0.3 * temp**2 * kl
    torch.testing.assert_close(kd_loss(s, t, y, alpha=0.3, temperature=temp), want)
    t.requires_grad_()
    kd_loss(s, t, y, alpha=0.5).backward()
    assert t.grad is None and s.grad is not None  # the teacher only teaches


def test_bad_kd_settings_name_the_value() -> None:
    x, y = torch.zeros(2, VOCAB), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="alpha must be in"):
        kd_loss(x, x, y, alpha=1.5)
    with pytest.raises(ValueError, match="temperature must be positive, got 0"):
        kd_loss(x, x, y, temperature=0)
    with pytest.raises(ValueError, match="stop_step"):
        StagedKD(0.5, -1)
    teacher = TinyMoELM(2)
    with pytest.raises(ValueError, match=r"teacher's 2 \(0..1\); got \[0, 5\]"):
        student_from_teacher(teacher, "blocks", [0, 5])
    with pytest.raises(ValueError, match=r"not an nn\.ModuleList"):
        student_from_teacher(teacher, "head", [0])


def test_student_keeps_the_chosen_teacher_layers() -> None:
    torch.manual_seed(0)
    teacher = TinyMoELM(4)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = student_from_teacher(teacher, "blocks", [0, 2])
    assert len(student.blocks) == 2 and len(teacher.blocks) == 4
    for i, j in ((0, 0), (1, 2)):
        for (name, p), q in zip(
            student.blocks[i].named_parameters(), teacher.blocks[j].parameters(), strict=True
        ):
            assert torch.equal(p, q) and p is not q, name
    student.head.weight.data.add_(1.0)  # a copy: the teacher is untouched
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())
    assert StagedKD(0.5, 3)(2) == 0.5 and StagedKD(0.5, 3)(3) == 0.0


def _distil(teacher: nn.Module, alpha: float, steps: int) -> float:
    """Train a 2-layer student cut from ``teacher``; return its KL to the teacher on held-out data."""
    torch.manual_seed(1)
    student = student_from_teacher(teacher, "blocks", [0, 3])
    for p in student.parameters():  # the same perturbed start for both students
        p.data.add_(torch.randn_like(p) * 0.3)
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    for step in range(steps):
        x, y = _data(step)
        with torch.no_grad():
            t = teacher(x)
        kd_loss(student(x), t, y, alpha=alpha, temperature=2.0).backward()
        opt.step()
        opt.zero_grad()
    x, _ = _data(10_000, n=64)
    with torch.no_grad():
        log_t = torch.log_softmax(teacher(x).reshape(-1, VOCAB), -1)
        log_s = torch.log_softmax(student(x).reshape(-1, VOCAB), -1)
    return float(F.kl_div(log_s, log_t, log_target=True, reduction="batchmean"))


def test_distilled_student_is_closer_to_its_teacher_than_one_trained_on_labels() -> None:
    torch.manual_seed(0)
    teacher = TinyMoELM(4)
    opt = torch.optim.Adam(teacher.parameters(), lr=3e-3)
    for step in range(40):
        x, y = _data(step)
        F.cross_entropy(teacher(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    teacher.eval()
    labels_only, distilled = _distil(teacher, 0.0, 25), _distil(teacher, 0.9, 25)
    assert distilled < 0.8 * labels_only, (distilled, labels_only)
