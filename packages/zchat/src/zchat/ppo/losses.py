"""PPO's per-token math, as DeepSpeed-Chat's step-3 trainer does it (InstructGPT's recipe).

Shapes: every tensor is over the response tokens of a batch, ``[B, T]`` with ``T`` the longest
response; ``mask [B, T]`` is 1 on real response tokens and 0 on padding (the prompt is never
in these tensors). ``logprobs`` are the actor's log-probabilities of the tokens it generated,
``values`` the critic's value of the state *before* each token.

* reward (:func:`kl_penalized_rewards`): every token is rewarded ``-kl_coef * (logp - logp_ref)``
  (a per-token estimate of KL(actor || reference)); the reward model's score, clipped to
  ``[-clip_reward, clip_reward]``, is added at each response's last real token.
* advantages (:func:`gae`): generalized advantage estimation, ``delta_t = r_t + gamma *
  V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}`` backward from the last real
  token (``V`` after it is 0: the episode ends); returns ``A + V``. DeepSpeed-Chat uses
  them as they are; with ``whiten_advantages`` (:func:`masked_whiten`, as TRL and OpenRLHF
  do) the policy loss gets them shifted and scaled to mean 0, variance 1 over the batch's
  response tokens (the returns keep the raw ones).
* policy loss (:func:`policy_loss`): ``max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))``
  with ``ratio = exp(logp - logp_old)``, the masked mean over tokens.
* value loss (:func:`value_loss`): ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with ``V_clip``
  the new value held within ``eps_v`` of the rollout's, the masked mean.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (0 when there are none)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``x`` shifted and scaled to mean 0 and variance 1 (the biased one) over the positions
    where ``mask`` is 1; 0 elsewhere."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    return (x - mean) * torch.rsqrt(var + eps) * m


def kl_penalized_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    clip_reward: float,
) -> torch.Tensor:
    """Per-token rewards ``[B, T]``: the KL penalty on every token, plus the clipped score
    ``scores [B]`` on each row's last real token. A row without response tokens gets none."""
    rewards = -kl_coef * (logprobs - ref_logprobs) * mask.to(logprobs.dtype)
    lengths = mask.long().sum(1)
    last = (lengths - 1).clamp(min=0)
    bonus = scores.clamp(-clip_reward, clip_reward).to(rewards.dtype) * (lengths > 0)
    return rewards.scatter_add(1, last[:, None], bonus[:, None])


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each ``[B, T]`` and 0 on padding; see the module docstring.
    Right-padded rows: the value after the last real token is taken as 0."""
    m = mask.to(values.dtype)
    values = values * m
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # a padded position carries nothing back: its advantage is 0 and it resets the sum
        running = (delta + gamma * lam * running) * m[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * m


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate (a scalar to minimise) and diagnostics: the fraction of
    tokens whose ratio was clipped, and the approximate KL to the rollout policy."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        frac = masked_mean((clipped > unclipped).float(), mask)
        approx_kl = masked_mean(old_logprobs - logprobs, mask)
    return loss, {"clip_frac": float(frac), "approx_kl": float(approx_kl)}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> torch.Tensor:
    """The critic's clipped value loss (a scalar to minimise)."""
    clipped = torch.maximum(torch.minimum(values, old_values + clip), old_values - clip)
    worst = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(worst, mask)
