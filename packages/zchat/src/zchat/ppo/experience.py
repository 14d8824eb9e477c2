"""One rollout turned into PPO's per-token tensors: the hand-off between generation and the
update.

Sequences are ``prompt + response`` per row, right-padded (``ids [B, L]``, ``attn [B, L]``).
A causal LM's logits at position ``p`` predict token ``p + 1``, so the log-probability of
response token ``j`` of row ``i`` (at sequence position ``P_i + j``, ``P_i`` the prompt's
length) is read at row ``P_i + j - 1`` of the logits, and the critic's value of the state
before it at the same position. :func:`response_view` gathers those rows into
``[B, T]`` response tensors (``T`` the longest response) with ``mask [B, T]``, the layout
:mod:`zchat.ppo.losses` works on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zchat.data.render import pad_right


@dataclass
class Batch:
    """A rollout's sequences and where each response sits in them."""

    ids: torch.Tensor
    """``[B, L]`` prompt + response, right-padded."""
    attn: torch.Tensor
    """``[B, L]`` 1 on real tokens."""
    index: torch.Tensor
    """``[B, T]`` position in ``ids`` of the logits row that predicts each response token."""
    mask: torch.Tensor
    """``[B, T]`` 1 on real response tokens."""
    targets: torch.Tensor
    """``[B, T]`` the response tokens (0 on padding)."""

    @classmethod
    def build(cls, prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Batch:
        rows = [p + r for p, r in zip(prompts, responses, strict=True)]
        ids, attn = pad_right(rows, pad_id)
        width = max(1, max(len(r) for r in responses))
        index = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width)
        targets = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            n = len(r)
            index[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)
            mask[i, :n] = 1.0
            targets[i, :n] = torch.tensor(r, dtype=torch.long)
        return cls(ids, attn, index, mask, targets)


def response_view(x: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``x [B, L, ...]`` per sequence position to ``[B, T, ...]`` per response token."""
    idx = batch.index
    if x.dim() == 3:
        return x.gather(1, idx[:, :, None].expand(-1, -1, x.shape[-1]))
    return x.gather(1, idx)


def token_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The log-probability ``[B, T]`` under ``model`` (a causal LM, or a ZeRO engine of one) of
    each response token; differentiable (wrap in ``no_grad`` for a frozen model). Only the
    response rows go through the LM head (transformers' ``logits_to_keep`` with per-row
    positions): the ``[B, L, V]`` logits of the prompts are never built."""
    rows = model(
        input_ids=batch.ids, attention_mask=batch.attn, logits_to_keep=batch.index
    ).logits.float()  # [B, T, V]
    logp = torch.log_softmax(rows, dim=-1)
    return logp.gather(2, batch.targets[:, :, None]).squeeze(2) * batch.mask


class Critic(torch.nn.Module):
    """PPO's critic: a :class:`zchat.reward.RewardModel` (it starts as the trained reward
    model, as in DeepSpeed-Chat) whose ``forward`` is the value at every position ``[B, L]``,
    so a ZeRO engine wraps it like any model."""

    def __init__(self, reward_model: torch.nn.Module) -> None:
        super().__init__()
        self.rm = reward_model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.rm.values(input_ids, attention_mask)


def critic_values(critic: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The critic's value ``[B, T]`` of the state before each response token."""
    return response_view(critic(batch.ids, batch.attn).float(), batch) * batch.mask
