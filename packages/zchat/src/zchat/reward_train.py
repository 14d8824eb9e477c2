"""Training the reward model (``z chat reward``): pairwise loss under ZeRO-3, held-out
pairwise accuracy before and after.

The model is the SFT model's backbone plus a fresh scalar head (:mod:`zchat.reward`), built
partitioned; each micro-batch holds ``micro_batch`` pairs, chosen and rejected answers
rendered with the chat template in one right-padded batch, scored at their last real token
(the end-of-turn token; or the answer's own last token, ``score_at`` ``before_eos``), and
trained with ``-logsigmoid(r_chosen - r_rejected)``. Every
rank holds the same number of pairs, so the per-rank mean averaged by ZeRO is the global
mean. The held-out metric is the fraction of held-out pairs the model ranks as the task's
rule does (``r_chosen > r_rejected``) and the mean margin.

Trained this way from a fresh head, the reward model stays near chance for the steps a CPU
affords; the levers below (``score_at``, ``head_lr``, the head-only warm-up) lift its start,
and the **block warm-up** (``warmup_blocks``, :mod:`zchat.reward_blocks`) is what ``z chat
e2e`` runs. Measured runs of each: ``benchmarks/results/zchat-reward.md``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch

from zchat.config import StageConfig
from zchat.data import PreferencePair, load_tokenizer, require_nonempty
from zchat.data.render import pair_batch
from zchat.reward import build_reward_model, pairwise_loss, save_reward_model
from zchat.reward_blocks import load_warm_weights, warm_blocks
from zchat.reward_warmup import warm_head
from zchat.sft import Plays, build_stage_data, check_model_dir
from zchat.train_loop import (
    Recorder,
    all_sum,
    ds_config,
    global_batches,
    heldout_shard,
    lr_factor,
    rank_micro_batches,
    scheduler_for,
)


class RewardConfig(StageConfig):
    """``z chat reward``; ``model`` is the SFT output. ``lr`` 5e-5 is DeepSpeed-Chat's step-2
    default; the keys below it are zchat's (their defaults are DeepSpeed-Chat's behaviour:
    score at the last token, one learning rate, no warm-up)."""

    lr: float = 5e-5
    score_at: Literal["last", "before_eos"] = "last"
    """Where a row's score is read: its last token (DeepSpeed-Chat; the end-of-turn token of
    a finished answer) or the answer's own last token (``before_eos``, :mod:`zchat.reward`)."""
    head_lr: float | None = None
    """Peak learning rate of the value head (``v_head``); the backbone keeps ``lr``.
    ``None``: ``lr``."""
    head_warmup_pairs: int = 0
    """Training pairs (the first ones; all of them when the split is smaller) the head-only
    warm-up fits the head on before training, with the backbone frozen
    (:mod:`zchat.reward_warmup`); 0: no warm-up, a fresh head."""
    head_warmup_l2: float = 1e-4
    """The warm-up's L2 penalty on the head (``l2 * |w|^2``; larger: a smaller head that
    overfits the warm-up pairs less)."""
    head_warmup_iters: int = 200
    """The warm-up's L-BFGS iterations."""
    warmup_blocks: int = 0
    """Top decoder blocks trained, with the final norm and the head, on cached inputs of the
    frozen blocks below before the ZeRO-3 steps (:mod:`zchat.reward_blocks`); 0: none."""
    warmup_epochs: int = 3
    """Passes of the block warm-up over the training pairs."""
    warmup_batch: int = 16
    """Pairs per block warm-up step, over all ranks."""
    warmup_lr: float = 1e-4
    """The block warm-up's AdamW learning rate for the blocks and the norm (constant)."""
    warmup_head_lr: float = 1e-3
    """The block warm-up's learning rate for the head."""

    def zero_steps_allowed(self) -> bool:
        """``steps`` 0 (no ZeRO-3 step) is a reward model trained by the block warm-up."""
        return self.warmup_blocks > 0

    def model_post_init(self, context: Any, /) -> None:
        if self.steps == 0 and not self.warmup_blocks:
            raise ValueError(
                "`steps` 0 trains nothing: it needs a block warm-up "
                "(`warmup_blocks` ≥ 1), or set `steps` ≥ 1"
            )
        super().model_post_init(context)
        if self.warmup_blocks < 0 or self.warmup_epochs < 1 or self.warmup_batch < 1:
            raise ValueError("`warmup_blocks` must be ≥ 0, `warmup_epochs` and `warmup_batch` ≥ 1")
        if not (self.warmup_lr > 0 and self.warmup_head_lr > 0):
            raise ValueError("`warmup_lr` and `warmup_head_lr` must be > 0")
        if self.head_lr is not None and not self.head_lr > 0:
            raise ValueError(f"`head_lr` must be > 0 (or null: `lr`), got {self.head_lr}")
        if self.head_warmup_pairs < 0 or self.head_warmup_l2 < 0 or self.head_warmup_iters < 1:
            raise ValueError(
                "`head_warmup_pairs` and `head_warmup_l2` must be ≥ 0 and `head_warmup_iters` ≥ 1"
            )


def prepare_reward(cfg: RewardConfig, plays: tuple[Plays, Plays] = (None, None)) -> None:
    """Checks before ranks start: weights, chat template, non-empty pair splits."""
    check_model_dir(cfg.model)
    data = build_stage_data(cfg, plays)
    require_nonempty(data.pairs_train, "pairs_train", "raise `train_examples`")
    require_nonempty(data.pairs_heldout, "pairs_heldout", "raise `heldout_examples`")


def score_pairs(
    model: Any, tokenizer: Any, pairs: list[PreferencePair], max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen ``[B]``, r_rejected ``[B]``) in one forward."""
    b = pair_batch(tokenizer, pairs, max_len)
    scores = model(b["input_ids"], b["attention_mask"])
    return scores[: len(pairs)], scores[len(pairs) :]


def evaluate_pairs(
    model: Any, tokenizer: Any, pairs: list[PreferencePair], cfg: StageConfig, rank: int, world: int
) -> dict[str, float]:
    """Held-out pairwise accuracy (``r_chosen > r_rejected``) and mean margin, all ranks."""
    right = margin = counted = 0.0
    model.eval()
    with torch.no_grad():
        for batch in heldout_shard(pairs, rank, world, cfg.eval_batch):
            chosen, rejected = score_pairs(model, tokenizer, [p for p, _ in batch], cfg.max_len)
            keep = torch.tensor([k for _, k in batch], dtype=torch.float64)
            diff = (chosen - rejected).double()
            right += float(((diff > 0).double() * keep).sum())
            margin += float((diff * keep).sum())
            counted += float(keep.sum())
    right, margin, counted = all_sum(right, margin, counted)
    return {"accuracy": right / max(counted, 1.0), "margin": margin / max(counted, 1.0)}


def _epoch_line(epoch: int, loss: float, heldout: float) -> None:
    print(
        f"[reward] block warm-up epoch {epoch} loss {loss:.4g} heldout_accuracy {heldout:.4g}",
        flush=True,
    )


def train_reward(
    rank: int, world: int, cfg: RewardConfig, plays: tuple[Plays, Plays] = (None, None)
) -> dict[str, Any]:
    """One rank of ``z chat reward`` (collective): train, evaluate, save ``cfg.out``."""
    import zcore

    start = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    data = build_stage_data(cfg, plays)
    ds = ds_config(cfg, world)
    head, warm = None, {}
    if cfg.head_warmup_pairs:
        head, warm = warm_head(
            cfg.model,
            tokenizer,
            data.pairs_train[: cfg.head_warmup_pairs],
            data.pairs_heldout,
            cfg,
            rank,
            world,
        )
    blocks: dict[str, torch.Tensor] = {}
    if cfg.warmup_blocks:
        blocks, more = warm_blocks(
            cfg.model,
            tokenizer,
            data.pairs_train,
            data.pairs_heldout,
            cfg,
            rank,
            world,
            head=head,
            log=_epoch_line if rank == 0 else None,
        )
        warm = {**warm, **more}
    model = build_reward_model(
        cfg.model,
        ds_config=ds,
        seed=cfg.seed,
        head=head,
        score_at=cfg.score_at,
        eos_id=tokenizer.eos_token_id,
    )
    if blocks:
        load_warm_weights(model, blocks)
    groups = None
    if cfg.head_lr is not None:  # the backbone at `lr`, the head at `head_lr`
        head_params = list(model.v_head.parameters())
        rest = [p for p in model.parameters() if all(p is not h for h in head_params)]
        groups = [{"params": rest}, {"params": head_params, "lr": cfg.head_lr}]
    engine, *_ = zcore.initialize(
        model, config=ds, model_parameters=groups, lr_scheduler=scheduler_for(cfg)
    )
    rec = Recorder("reward", cfg.out, cfg.steps, rank)
    if warm:
        rec.write({"stage": "reward", "step": 0, **warm})
    before = evaluate_pairs(engine, tokenizer, data.pairs_heldout, cfg, rank, world)
    rec.write({"stage": "reward", "step": 0, **{f"heldout_{k}": v for k, v in before.items()}})
    per_step = cfg.micro_batch * cfg.grad_accum * world
    losses = []
    train_start = time.perf_counter()
    for step, batch in enumerate(
        global_batches(data.pairs_train, per_step, cfg.steps, cfg.seed), 1
    ):
        engine.train()
        loss_sum = right = seen = 0.0
        for micro in rank_micro_batches(batch, rank, world, cfg.micro_batch):
            b = pair_batch(tokenizer, micro, cfg.max_len)
            scores = engine(b["input_ids"], b["attention_mask"])
            chosen, rejected = scores[: len(micro)], scores[len(micro) :]
            loss = pairwise_loss(chosen, rejected)
            engine.backward(loss)
            engine.step()
            loss_sum += float(loss.detach()) * len(micro)
            right += float((chosen > rejected).sum())
            seen += float(b["attention_mask"].sum())
        loss_all, right_all, seen_all = all_sum(loss_sum, right, seen)
        losses.append(loss_all / len(batch))
        if step % cfg.log_every == 0 or step == cfg.steps:
            rec.step(
                step,
                int(seen_all),
                loss=losses[-1],
                acc=right_all / len(batch),
                lr=cfg.lr * lr_factor(cfg, step - 1),
            )
    train_s = time.perf_counter() - train_start
    after = evaluate_pairs(engine, tokenizer, data.pairs_heldout, cfg, rank, world)
    rec.write(
        {"stage": "reward", "step": cfg.steps, **{f"heldout_{k}": v for k, v in after.items()}}
    )
    extra = {
        "heldout_accuracy": after["accuracy"],
        "heldout_pairs": len(data.pairs_heldout),
        "rule": data.rule,
        **{k: v for k, v in warm.items() if k != "blocks_losses"},
    }
    save_reward_model(engine, cfg.out, tokenizer=tokenizer, source=cfg.model, extra=extra)
    engine.destroy()
    return {
        "losses": losses,
        "heldout_before": before,
        "heldout_after": after,
        "out": cfg.out,
        "warmup": warm,
        "metrics": str(rec.path),
        "train_s": train_s,
        "total_s": time.perf_counter() - start,
    }
