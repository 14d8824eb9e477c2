"""The reward model's block warm-up: its top decoder blocks, final norm and head trained on
cached inputs, the blocks below them frozen.

Why: a reward model on the arithmetic task must tell ``81`` from ``84`` after ``23 + 58``;
the SFT backbone's final state at the answer's last digit does not hold that linearly (a
linear probe on it: 0.59-0.69 of held-out pairs, :mod:`zchat.reward_warmup`), and
fine-tuning the whole backbone with DeepSpeed-Chat's recipe stayed at ln 2 for the steps a
CPU affords (:mod:`zchat.reward_train`). The comparison can be learnt by the top blocks,
and those are cheap to train when the frozen blocks below run once: one no-grad forward
over the training pairs caches each answer's hidden states at the input of block
``L - warmup_blocks`` (``output_hidden_states[L - K]``), and every epoch after that runs
only the top ``K`` blocks (``K / L`` of a forward and backward).

Data parallel over ranks: the pairs are split for the cached forward and the caches are
all-gathered (every rank holds every pair's cached rows, unpadded, in pair order); each
optimizer step takes ``warmup_batch`` pairs in a seeded order, rank ``r`` the ones at
positions ``r, r + world, ...``, and the gradients are averaged over ranks before AdamW, so
every rank ends with the same weights, those of one process taking the same steps. The
trained tensors are handed back by name (``backbone`` parameter names plus ``v_head``) and
copied into the ZeRO-3 reward model by :func:`load_warm_weights`.

Measured runs (held-out accuracy per epoch, time): ``benchmarks/results/zchat-reward.md``.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zchat.data import PreferencePair
from zchat.data.render import pair_batch

Row = tuple[torch.Tensor, torch.Tensor]
"""One rendered answer's cached rows: (hidden ``[T, H]`` at the first trained block's
input, token ids ``[T]``), unpadded."""


class TopBlocks(nn.Module):
    """The top ``blocks`` decoder blocks of a reward model's backbone, its final norm and its
    head (the modules themselves, not copies): ``forward(hidden, ids, mask) -> [B]``, the
    score a :class:`zchat.reward.RewardModel` gives the same right-padded rows when
    ``hidden`` is its backbone's hidden state at the first of these blocks."""

    def __init__(self, reward_model: Any, blocks: int) -> None:
        super().__init__()
        backbone = reward_model.backbone
        layers = backbone.layers
        if not 1 <= blocks <= len(layers):
            raise ValueError(
                f"`warmup_blocks` must be in 1..{len(layers)} (the backbone's "
                f"decoder blocks), got {blocks}"
            )
        self.first = len(layers) - blocks
        self.layers = nn.ModuleList(layers[self.first :])
        self.norm, self.rotary = backbone.norm, backbone.rotary_emb
        self.v_head = reward_model.v_head
        self.reward_model = [reward_model]  # a list: not a submodule (score_index only)

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        positions = torch.arange(t)[None].expand(b, t)
        rope = self.rotary(hidden, positions)
        # causal and key padding, additive (what the backbone builds from `mask`)
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :]
        bias = torch.zeros(b, 1, t, t, dtype=hidden.dtype)
        bias.masked_fill_(~allowed[:, None], torch.finfo(hidden.dtype).min)
        for layer in self.layers:
            out = layer(
                hidden, attention_mask=bias, position_ids=positions, position_embeddings=rope
            )
            hidden = out[0] if isinstance(out, tuple) else out
        values = self.v_head(self.norm(hidden))  # [B, T]
        at = self.reward_model[0].score_index(ids, mask)
        return values.gather(1, at[:, None]).squeeze(1)


def cached_rows(
    model: Any, tokenizer: Any, pairs: list[PreferencePair], first: int, max_len: int, batch: int
) -> list[tuple[Row, Row]]:
    """(chosen, rejected) cached rows of each pair: the backbone's hidden state at block
    ``first``'s input, no gradients."""
    out: list[tuple[Row, Row]] = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(pairs), batch):
            part = pairs[i : i + batch]
            b = pair_batch(tokenizer, part, max_len)  # chosen rows, then rejected
            hs = model.backbone(
                input_ids=b["input_ids"],
                attention_mask=b["attention_mask"],
                output_hidden_states=True,
            ).hidden_states[first]
            lengths = b["attention_mask"].sum(1).tolist()
            rows = [
                (hs[j, : lengths[j]].clone(), b["input_ids"][j, : lengths[j]].clone())
                for j in range(2 * len(part))
            ]
            out += list(zip(rows[: len(part)], rows[len(part) :], strict=True))
    return out


def gathered_rows(
    model: Any,
    tokenizer: Any,
    pairs: list[PreferencePair],
    first: int,
    max_len: int,
    batch: int,
    rank: int,
    world: int,
) -> list[tuple[Row, Row]]:
    """:func:`cached_rows` of every pair, in pair order: rank ``r`` runs pairs ``r, r +
    world, ...`` and the shares are all-gathered."""
    mine = cached_rows(model, tokenizer, pairs[rank::world], first, max_len, batch)
    if world == 1 or not dist.is_initialized():
        return mine
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, mine)
    out: list[Any] = [None] * len(pairs)
    for r, share in enumerate(shares):
        out[r::world] = share
    return out


def padded(rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden ``[B, T, H]``, ids ``[B, T]``, mask ``[B, T]``) of ``rows``, right-padded."""
    t = max(len(ids) for _, ids in rows)
    hidden = torch.zeros(len(rows), t, rows[0][0].shape[1], dtype=rows[0][0].dtype)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for j, (h, i) in enumerate(rows):
        hidden[j, : len(i)], ids[j, : len(i)], mask[j, : len(i)] = h, i, 1
    return hidden, ids, mask


def pair_scores(top: TopBlocks, pairs: list[tuple[Row, Row]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen, r_rejected) of cached pairs in one forward of the top blocks."""
    scores = top(*padded([c for c, _ in pairs] + [r for _, r in pairs]))
    return scores[: len(pairs)], scores[len(pairs) :]


def cached_accuracy(top: TopBlocks, pairs: list[tuple[Row, Row]], batch: int) -> float:
    """Fraction of cached pairs with ``r_chosen > r_rejected``."""
    right = 0
    with torch.no_grad():
        for i in range(0, len(pairs), batch):
            chosen, rejected = pair_scores(top, pairs[i : i + batch])
            right += int((chosen > rejected).sum())
    return right / max(len(pairs), 1)


def step_batches(count: int, per_step: int, epochs: int, seed: int) -> list[list[int]]:
    """Pair indices of each optimizer step: ``epochs`` seeded passes over ``count`` pairs in
    steps of ``per_step`` (the last step of a pass may be short)."""
    rng = random.Random(f"zchat-reward-blocks-{seed}")
    steps = []
    for _ in range(epochs):
        order = list(range(count))
        rng.shuffle(order)
        steps += [order[i : i + per_step] for i in range(0, count, per_step)]
    return steps


def _sum_grads(params: list[nn.Parameter], world: int) -> None:
    """Each rank's gradient becomes the sum over ranks (one flat all-reduce)."""
    if world == 1 or not dist.is_initialized():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def train_top_blocks(
    top: TopBlocks,
    train: list[tuple[Row, Row]],
    *,
    epochs: int,
    per_step: int,
    lr: float,
    head_lr: float,
    seed: int,
    rank: int,
    world: int,
    on_epoch: Any = None,
) -> list[float]:
    """AdamW on the top blocks and norm (``lr``) and the head (``head_lr``), pairwise loss,
    gradients averaged over ranks; returns each step's global mean loss."""
    head = list(top.v_head.parameters())
    body = [p for p in top.parameters() if all(p is not h for h in head)]
    for p in top.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(
        [{"params": body, "lr": lr}, {"params": head, "lr": head_lr}], weight_decay=0.0
    )
    params = body + head
    losses: list[float] = []
    steps = step_batches(len(train), per_step, epochs, seed)
    per_epoch = -(-len(train) // per_step)
    top.train()
    for n, idx in enumerate(steps, 1):
        share = idx[rank::world]
        if share:
            chosen, rejected = pair_scores(top, [train[i] for i in share])
            # the global mean: each rank's sum over its share, over the step's pairs
            loss = -F.logsigmoid(chosen - rejected).sum() / len(idx)
            loss.backward()
            value = float(loss.detach())
        else:
            value = 0.0
        _sum_grads(params, world)  # each share's sum / the step's pairs: summed = the mean
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = torch.tensor([value], dtype=torch.float64)
        if world > 1 and dist.is_initialized():
            dist.all_reduce(total)
        losses.append(float(total))
        if on_epoch is not None and n % per_epoch == 0:
            on_epoch(n // per_epoch, losses[-per_epoch:])
    top.eval()
    return losses


def warm_blocks(
    lm_dir: str,
    tokenizer: Any,
    pairs: list[PreferencePair],
    heldout: list[PreferencePair],
    cfg: Any,
    rank: int,
    world: int,
    head: torch.Tensor | None = None,
    log: Any = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The warmed tensors by name (the top ``cfg.warmup_blocks`` blocks' and the final
    norm's ``backbone.*`` parameters, and ``v_head.weight``) and the warm-up's statistics
    (held-out accuracy before and after each epoch, losses). Collective when ``world`` > 1.
    ``head``: the head to start from (a head-only warm-up's); default zeros, so the loss
    starts at ln 2 and the blocks' first gradients come through a head the data shapes."""
    from zchat.reward import build_reward_model

    whole = build_reward_model(
        lm_dir, seed=cfg.seed, score_at=cfg.score_at, eos_id=tokenizer.eos_token_id, head=head
    )
    if head is None:
        with torch.no_grad():
            whole.v_head.weight.zero_()
    top = TopBlocks(whole, cfg.warmup_blocks)
    for p in whole.parameters():
        p.requires_grad_(False)
    train = gathered_rows(
        whole, tokenizer, pairs, top.first, cfg.max_len, cfg.eval_batch, rank, world
    )
    held = cached_rows(
        whole, tokenizer, heldout[rank::world], top.first, cfg.max_len, cfg.eval_batch
    )
    held_n = len(heldout)

    def held_accuracy() -> float:
        right = torch.tensor(
            [cached_accuracy(top, held, cfg.eval_batch) * len(held)], dtype=torch.float64
        )
        if world > 1 and dist.is_initialized():
            dist.all_reduce(right)
        return float(right) / max(held_n, 1)

    curve = [held_accuracy()]

    def on_epoch(epoch: int, losses: list[float]) -> None:
        curve.append(held_accuracy())
        if log is not None:
            log(epoch, sum(losses) / len(losses), curve[-1])

    losses = train_top_blocks(
        top,
        train,
        epochs=cfg.warmup_epochs,
        per_step=cfg.warmup_batch,
        lr=cfg.warmup_lr,
        head_lr=cfg.warmup_head_lr,
        seed=cfg.seed,
        rank=rank,
        world=world,
        on_epoch=on_epoch,
    )
    names = {id(p): n for n, p in whole.named_parameters()}
    warm = {names[id(p)]: p.detach().clone() for p in top.parameters()}
    stats = {
        "blocks": cfg.warmup_blocks,
        "blocks_pairs": len(pairs),
        "blocks_heldout_accuracy": curve,
        "blocks_losses": losses,
    }
    return warm, stats


def load_warm_weights(model: nn.Module, warm: dict[str, torch.Tensor]) -> None:
    """Copy the warmed tensors into ``model`` (a reward model, partitioned by ZeRO-3 or
    whole); every rank holds the same tensors, rank 0's are the ones written. Collective
    under ZeRO-3."""
    from zcore.zero import GatheredParameters

    named = dict(model.named_parameters())
    missing = sorted(set(warm) - set(named))
    if missing:
        raise KeyError(f"warmed tensors name no parameter of the model: {missing[:3]}")
    params = [named[n] for n in warm]
    with GatheredParameters(params, modifier_rank=0), torch.no_grad():
        for name, p in zip(warm, params, strict=True):
            p.copy_(warm[name])
