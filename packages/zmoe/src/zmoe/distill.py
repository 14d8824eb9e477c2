"""Mixture-of-Students (DeepSpeed-MoE, section 4): distil a shallower MoE from an MoE teacher.

The student is the teacher with some of its layers removed (the paper keeps the expert
count per layer and cuts depth), started from the teacher's weights for the layers it
keeps. It trains on ``(1 - alpha) * CE(labels) + alpha * T^2 * KL(teacher_T || student_T)``
(``T`` the temperature), and the paper's *staged* KD turns the KL term off after a number
of steps: late in training the student's smaller capacity is better spent on the labels
alone than on imitating the teacher.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def student_from_teacher(teacher: nn.Module, layers: str, keep: Sequence[int]) -> nn.Module:
    """A copy of ``teacher`` whose ``nn.ModuleList`` attribute ``layers`` (a dotted path such
    as ``"transformer.h"``) holds only the layers at indices ``keep``, in that order, with the
    teacher's weights. The teacher is not changed."""
    owner_path, _, attr = layers.rpartition(".")
    student = copy.deepcopy(teacher)
    owner = student.get_submodule(owner_path) if owner_path else student
    stack = getattr(owner, attr, None)
    if not isinstance(stack, nn.ModuleList):
        raise ValueError(f"`{layers}` is not an nn.ModuleList of {type(teacher).__name__}")
    bad = [i for i in keep if not 0 <= i < len(stack)]
    if not keep or bad or len(set(keep)) != len(keep):
        raise ValueError(
            f"keep must name distinct layers among the teacher's {len(stack)} "
            f"(0..{len(stack) - 1}); got {list(keep)}"
        )
    setattr(owner, attr, nn.ModuleList(stack[i] for i in keep))
    return student


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    alpha: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """``(1 - alpha) * CE + alpha * T^2 * KL(softmax(teacher/T) || softmax(student/T))``,
    both averaged over the positions whose target is not ``ignore_index``.

    Logits are ``[..., vocab]``, targets ``[...]``; the teacher gets no gradient.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    vocab = student_logits.shape[-1]
    s = student_logits.reshape(-1, vocab).float()
    t = teacher_logits.detach().reshape(-1, vocab).float()
    y = targets.reshape(-1)
    keep = y != ignore_index
    ce = F.cross_entropy(s, y, ignore_index=ignore_index)
    if alpha == 0.0:
        return ce
    log_s = F.log_softmax(s[keep] / temperature, dim=-1)
    log_t = F.log_softmax(t[keep] / temperature, dim=-1)
    kl = F.kl_div(log_s, log_t, log_target=True, reduction="batchmean")
    return (1 - alpha) * ce + alpha * temperature**2 * kl


class StagedKD:
    """The KD weight by step: ``alpha`` until ``stop_step``, then 0 (labels only)."""

    def __init__(self, alpha: float = 0.5, stop_step: int | None = None) -> None:
        if stop_step is not None and stop_step < 0:
            raise ValueError(f"stop_step must be >= 0 or None, got {stop_step}")
        self.alpha = alpha
        self.stop_step = stop_step

    def __call__(self, step: int) -> float:
        return self.alpha if self.stop_step is None or step < self.stop_step else 0.0
