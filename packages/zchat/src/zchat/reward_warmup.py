"""The reward head's head-only warm-up: a linear probe on the frozen backbone.

A fresh head (``U(±1/sqrt(hidden))``) on an SFT backbone scores chosen and rejected answers
alike, so the pairwise loss starts at ln 2 and the backbone's gradient through that head
carries little signal (the loss stays at ln 2 for the steps a CPU affords). The warm-up
fits the head first with the backbone frozen: one no-grad forward over ``head_warmup_pairs``
training pairs gives the hidden state at each answer's scored token
(:meth:`zchat.reward.RewardModel.scored_hidden`), and the head is the minimiser of the
pairwise loss on those fixed features plus ``l2 * |w|^2`` (full-batch L-BFGS in float64: a
convex problem, so a few hundred iterations reach its optimum), which AdamW steps on the head
alone do not reach (measured optima and runs: ``benchmarks/results/zchat-reward.md``). The
backbone is never updated here: the warmed head is handed to
:func:`zchat.reward.build_reward_model`, which loads the backbone from disk again.

Ranks split the pairs, each scores its share with a whole (unpartitioned) copy of the model,
and the features are all-gathered in pair order, so every rank fits the same head from the
same float64 features (deterministic L-BFGS: bit-identical heads on every rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zchat.data import PreferencePair
from zchat.data.render import pair_batch


def probe_features(
    model: Any, tokenizer: Any, pairs: list[PreferencePair], max_len: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen ``[N, H]``, rejected ``[N, H]``) float64 hidden states at the scored token of
    each pair's answers, without gradients."""
    chosen, rejected = [], []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(pairs), batch):
            part = pairs[i : i + batch]
            b = pair_batch(tokenizer, part, max_len)  # chosen rows, then rejected
            h = model.scored_hidden(b["input_ids"], b["attention_mask"]).double()
            chosen.append(h[: len(part)])
            rejected.append(h[len(part) :])
    return torch.cat(chosen), torch.cat(rejected)


def probe_loss(head: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """The pairwise loss of ``head`` (``[1, H]``) on fixed features."""
    diff = (chosen - rejected) @ head.reshape(-1).to(chosen.dtype)
    return float(-F.logsigmoid(diff).mean())


def fit_head(
    chosen: torch.Tensor, rejected: torch.Tensor, init: torch.Tensor, *, l2: float, iters: int
) -> torch.Tensor:
    """The head ``[1, H]`` minimising ``mean(-logsigmoid((c - r) @ w)) + l2 * |w|^2`` from
    ``init``: full-batch L-BFGS (strong Wolfe line search) in float64."""
    if chosen.shape != rejected.shape or chosen.dim() != 2:
        raise ValueError(
            f"features must be two [N, H] tensors, got {chosen.shape}, {rejected.shape}"
        )
    diff = (chosen - rejected).double()
    w = init.reshape(-1).double().clone().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [w],
        lr=1.0,
        max_iter=iters,
        tolerance_grad=1e-10,
        tolerance_change=1e-14,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = -F.logsigmoid(diff @ w).mean() + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().reshape(1, -1)


def gathered_features(
    model: Any,
    tokenizer: Any,
    pairs: list[PreferencePair],
    max_len: int,
    batch: int,
    rank: int,
    world: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`probe_features` of every pair, in pair order: rank ``r`` scores pairs
    ``r, r + world, ...`` and the shares are all-gathered."""
    mine = probe_features(model, tokenizer, pairs[rank::world], max_len, batch)
    if world == 1 or not dist.is_initialized():
        return mine
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, mine)
    hidden = mine[0].shape[1]
    chosen = torch.zeros(len(pairs), hidden, dtype=torch.float64)
    rejected = torch.zeros_like(chosen)
    for r, (c, rj) in enumerate(shares):
        chosen[r::world], rejected[r::world] = c, rj
    return chosen, rejected


def _accuracy(head: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    return float((((chosen - rejected) @ head.reshape(-1).double()) > 0).double().mean())


def warm_head(
    lm_dir: str,
    tokenizer: Any,
    pairs: list[PreferencePair],
    heldout: list[PreferencePair],
    cfg: Any,
    rank: int,
    world: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The warmed head ``[1, H]`` (float32) for a reward model from ``lm_dir``, and the
    probe's loss and accuracy on ``pairs`` and its accuracy on ``heldout`` with the fresh
    head and the warmed one (the reward model's held-out accuracy before any training, and
    after the warm-up alone). Collective when ``world`` > 1. ``cfg`` is a
    :class:`zchat.reward_train.RewardConfig` (seed, score_at, max_len, eval_batch,
    head_warmup_l2, head_warmup_iters)."""
    from zchat.reward import build_reward_model

    whole = build_reward_model(
        lm_dir, seed=cfg.seed, score_at=cfg.score_at, eos_id=tokenizer.eos_token_id
    )
    init = whole.v_head.weight.detach().clone()
    chosen, rejected = gathered_features(
        whole, tokenizer, pairs, cfg.max_len, cfg.eval_batch, rank, world
    )
    held = gathered_features(whole, tokenizer, heldout, cfg.max_len, cfg.eval_batch, rank, world)
    del whole
    head = fit_head(chosen, rejected, init, l2=cfg.head_warmup_l2, iters=cfg.head_warmup_iters)
    stats = {
        "probe_loss_before": probe_loss(init, chosen, rejected),
        "probe_loss_after": probe_loss(head, chosen, rejected),
        "probe_train_accuracy": _accuracy(head, chosen, rejected),
        "probe_pairs": float(len(pairs)),
        "heldout_accuracy_fresh_head": _accuracy(init, *held),
        "heldout_accuracy_warm_head": _accuracy(head, *held),
    }
    return head.float(), stats
