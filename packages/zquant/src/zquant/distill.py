"""Knowledge-distillation losses shared by XTC, LKD and the composer.

All take Hugging Face-style outputs or plain tensors; masks are the tokenizer's
`attention_mask` (B, T) with 1 for real tokens, so padding never pulls on the student.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def kl_logits_loss(student: Tensor, teacher: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(teacher || student) of softened logits (..., V), times T^2 (Hinton et al.)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    s = F.log_softmax(student.float().flatten(0, -2) / temperature, dim=-1)
    t = F.log_softmax(teacher.float().flatten(0, -2) / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def masked_mse(student: Tensor, teacher: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean squared error over the real tokens of (B, T, H) hidden states."""
    if student.shape != teacher.shape:
        raise ValueError(
            f"hidden shapes differ: student {tuple(student.shape)} vs teacher "
            f"{tuple(teacher.shape)}; distil layers of the same width"
        )
    err = (student.float() - teacher.float()).pow(2).mean(-1)  # (B, T)
    if mask is None:
        return err.mean()
    m = mask.to(err.dtype)
    return (err * m).sum() / m.sum().clamp_min(1.0)


def mean_pool(hidden: Tensor, mask: Tensor | None) -> Tensor:
    """Mean over real tokens: (B, T, H) -> (B, H)."""
    if mask is None:
        return hidden.mean(1)
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


def pooled_cosine_loss(student: Tensor, teacher: Tensor, mask: Tensor | None = None) -> Tensor:
    """1 - cosine of mean-pooled sentence embeddings, averaged over the batch."""
    s, t = mean_pool(student.float(), mask), mean_pool(teacher.float(), mask)
    return (1.0 - F.cosine_similarity(s, t, dim=-1)).mean()


def layer_map(student_layers: int, keep_layers: Sequence[int] | None) -> list[int]:
    """Teacher hidden-state index each student hidden state is distilled towards.

    `hidden_states[0]` is the embedding output, `hidden_states[i + 1]` layer i's output. The
    student's layer j mimics teacher layer `keep_layers[j]`, except the last, which mimics the
    teacher's last layer (so the final output is always the target).
    """
    keep = list(range(student_layers)) if keep_layers is None else list(keep_layers)
    if len(keep) != student_layers:
        raise ValueError(
            f"keep_layers {keep} names {len(keep)} layers but the student has {student_layers}"
        )
    return [0, *[k + 1 for k in keep[:-1]], -1]


def distill_loss(
    student_out: Any,
    teacher_out: Any,
    *,
    attention_mask: Tensor | None,
    mapping: Sequence[int] | None = None,
    temperature: float = 1.0,
    hidden_weight: float = 1.0,
    cosine_weight: float = 1.0,
    kl_weight: float = 1.0,
) -> tuple[Tensor, dict[str, float]]:
    """Single-stage KD: hidden-state MSE over mapped layers + pooled cosine + logits KL.

    `student_out` / `teacher_out` are model outputs with `hidden_states` (run with
    `output_hidden_states=True`) and, for language models, `logits`. Returns the loss and its
    parts as floats for logging.
    """
    parts: dict[str, Tensor] = {}
    s_hidden = getattr(student_out, "hidden_states", None)
    t_hidden = getattr(teacher_out, "hidden_states", None)
    if s_hidden is not None and t_hidden is not None and hidden_weight:
        mapping = list(mapping) if mapping is not None else list(range(len(s_hidden)))
        if len(mapping) != len(s_hidden):
            raise ValueError(
                f"mapping has {len(mapping)} entries for {len(s_hidden)} student hidden states"
            )
        mse = [
            masked_mse(s, t_hidden[i], attention_mask)
            for s, i in zip(s_hidden, mapping, strict=True)
        ]
        parts["hidden_mse"] = hidden_weight * torch.stack(mse).mean()
        if cosine_weight:
            parts["cosine"] = cosine_weight * pooled_cosine_loss(
                s_hidden[-1], t_hidden[-1], attention_mask
            )
    s_logits = getattr(student_out, "logits", None)
    t_logits = getattr(teacher_out, "logits", None)
    if s_logits is not None and t_logits is not None and kl_weight:
        parts["kl"] = kl_weight * kl_logits_loss(s_logits, t_logits, temperature)
    if not parts:
        raise ValueError(
            "nothing to distil: outputs carry neither hidden_states nor logits; "
            "call the models with output_hidden_states=True"
        )
    loss = torch.stack(list(parts.values())).sum()
    return loss, {k: float(v.detach()) for k, v in parts.items()}
